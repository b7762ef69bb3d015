"""One meaning, one status: every way a request fails has a gRPC code and an HTTP status that say the same."""

from __future__ import annotations

import grpc
import pytest

from scheduler_svc.api.grpc_status import STATUS_OF as GRPC_STATUS_OF
from scheduler_svc.api.http.errors import STATUS_OF as HTTP_STATUS_OF
from scheduler_svc.core import errors
from scheduler_svc.core.errors import RequestFailed

# gRPC's own mapping of its codes to HTTP statuses (the canonical one of google.rpc.Code).
HTTP_OF_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.INTERNAL: 500,
}
OUTCOMES = sorted((cls for cls in vars(errors).values()
                   if isinstance(cls, type) and issubclass(cls, RequestFailed) and cls is not RequestFailed),
                  key=lambda cls: cls.__name__)


@pytest.mark.parametrize("outcome", OUTCOMES, ids=lambda cls: cls.__name__)
def test_both_apis_give_each_outcome_the_same_status(outcome: type[RequestFailed]) -> None:
    assert HTTP_OF_GRPC[GRPC_STATUS_OF[outcome]] == HTTP_STATUS_OF[outcome]


def test_only_a_busy_server_says_retry_later() -> None:
    """RESOURCE_EXHAUSTED / 429 is what clients retry (the CLI's exit 5, "busy"): a queue that is full, nothing else."""
    busy = {cls for cls, code in GRPC_STATUS_OF.items() if code == grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert busy == {errors.QueueFull}
