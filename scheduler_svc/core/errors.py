"""Why a request was refused or ended without finishing: one exception type per outcome a caller can act on.

The core raises or reports these; each public API maps them to its own status in one table
(gRPC: ``api.grpc_status.STATUS_OF``, HTTP: ``api.http.errors.STATUS_OF``), so no status is decided twice.
"""

from __future__ import annotations


class RequestFailed(Exception):
    """Base of every reason a request fails; the message says what the caller can do."""


class InvalidRequest(RequestFailed, ValueError):
    """A request the engine refuses; ``field`` names what the caller must fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message

    def __reduce__(self) -> tuple:
        """Pickled by its two arguments (the API process reads it from the link, ``api.process_link``)."""
        return type(self), (self.field, self.reason)


class QueueFull(RequestFailed):
    """Too many requests or prompt tokens wait to be scheduled; the caller should retry later."""


class ServerStopping(RequestFailed):
    """The scheduler is shutting down and takes no more requests."""


STOPPING = "the scheduler is shutting down; retry on another replica or later"


class ExecutorUnavailable(RequestFailed):
    """The executor serves something requests cannot carry over to (another model or vocabulary)."""


class CacheTooSmall(RequestFailed):
    """The restarted executor's KV cache cannot hold this request any more."""


class EngineFailure(RequestFailed):
    """The executor keeps failing this work, or the loop hit a bug; the request may be retried."""


def internal_error(error: Exception) -> EngineFailure:
    """What a caller is told of a bug in the scheduler: its kind, not its details."""
    return EngineFailure(f"internal scheduler error ({type(error).__name__}); retry the request")
