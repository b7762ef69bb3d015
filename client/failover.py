"""Several schedulers behind one channel, and streams that outlive the scheduler serving them.

A comma list of servers becomes one static ``ipv4:``/``ipv6:`` target (grpcio's resolvers take only
addresses there, so host names are resolved once, here) and a ``dns:///name:port`` target re-resolves
by itself; either is balanced with gRPC's round_robin. When a stream fails with UNAVAILABLE (its
scheduler died, or is draining and refuses new work), ``Resumption`` resends the request with the
completion tokens received so far in ``GenerateRequest.resume``: round_robin sends it to a live
server, which carries on at the next position, so greedy and seeded streams equal an undisturbed one.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from common.channels import DRAINED_KEY
from nanoserve.v1 import generation_pb2 as pb

ROUND_ROBIN = ("grpc.service_config", '{"loadBalancingConfig": [{"round_robin": {}}]}')
# Resends of one stream after a failure, and the backoff before each (doubling to the last).
DEFAULT_MAX_RESUMES = 4
FIRST_DELAY_S = 0.1
MAX_DELAY_S = 2.0
# Tokens a response of a stream that ``generate`` joins carries: a 64th of the messages of one token each for the
# scheduler to send and the client to read (W1's split keeps level with in-process, which 16 did not), and a resumed
# stream computes at most this many again.
JOINED_STREAM_INTERVAL = 64


def address(server: str) -> tuple[int, str]:
    """``host:port`` (``[v6]:port`` too) as (address family, address as a static target names it)."""
    host, sep, port = server.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"server {server!r} is not host:port")
    host = host.strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:  # a host name: its IPv4 address when it has one, so that names mix with IPv4 literals
        try:
            found = socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)
        except socket.gaierror:
            found = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        ip = ipaddress.ip_address(found[0][4][0])
    return (6, f"[{ip}]:{port}") if ip.version == 6 else (4, f"{ip}:{port}")


def channel_target(target: str, servers: list[str] | None = None) -> tuple[str, bool]:
    """The gRPC target of ``servers`` (or of a comma list in ``target``), and whether to balance it."""
    if servers is None:
        servers = target.split(",") if "," in target else None
    if servers is None:
        return target, target.startswith("dns:")
    addresses = [address(s.strip()) for s in servers if s.strip()]
    families = {family for family, _ in addresses}
    if len(families) != 1:
        raise ValueError("servers must all be IPv4 or all IPv6 (one gRPC target holds one address family)")
    return f"ipv{families.pop()}:{','.join(a for _, a in addresses)}", True


def resumable(request: pb.GenerateRequest) -> bool:
    """Only a single choice resumes: the tokens of n > 1 choices would have to be resumed each on its own."""
    return request.sampling.n <= 1


def one_choice(request: pb.GenerateRequest) -> pb.GenerateRequest:
    """``request``, which asks for one completion; ValueError naming ``n`` if it asks for more."""
    if not resumable(request):
        raise ValueError(f"n={request.sampling.n} asks for {request.sampling.n} completions: choices() returns them")
    return request


def read_whole(request: pb.GenerateRequest) -> pb.GenerateRequest:
    """``request`` as ``generate`` streams it, to join the pieces: ``JOINED_STREAM_INTERVAL`` tokens a response
    unless the caller chose a ``stream_interval``."""
    if not request.HasField("stream_interval"):
        request.stream_interval = JOINED_STREAM_INTERVAL
    return request


def continued(held: pb.GenerateResponse) -> list[pb.GenerateResponse]:
    """A held ABORT response's piece without its finish, which a resend continues; nothing if it has none."""
    if not (held.token_ids or held.text):
        return []
    piece = pb.GenerateResponse()
    piece.CopyFrom(held)
    piece.ClearField("finish_reason")
    piece.ClearField("usage")
    return [piece]


@dataclass
class Resumption:
    """One stream across attempts: what was received, how many resends are left, and when to give up."""

    request: pb.GenerateRequest
    timeout: float | None
    max_resumes: int = DEFAULT_MAX_RESUMES
    # Resume a stream its scheduler drained: only worth it with other schedulers to go to.
    resume_drained: bool = False
    received: list[int] = field(default_factory=list)
    resumes: int = 0
    deadline: float | None = field(init=False)
    # An ABORT of the current attempt, handed over only once the stream's end says it was no drain.
    held: pb.GenerateResponse | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.deadline = None if self.timeout is None else time.monotonic() + self.timeout
        if not resumable(self.request):
            self.max_resumes = 0

    def attempt(self) -> pb.GenerateRequest:
        """The request to send now: the original plus the tokens received so far."""
        self.held = None
        if not self.received:
            return self.request
        request = pb.GenerateRequest()
        request.CopyFrom(self.request)
        request.resume.completion_token_ids.extend(self.received)
        request.ClearField("prompt_logprobs")  # they came with the first response
        request.ClearField("return_prompt_token_ids")  # so did these
        return request

    def remaining_s(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def receive(self, response: pb.GenerateResponse) -> list[pb.GenerateResponse]:
        """The responses to hand the caller now; an ABORT waits for ``finish``."""
        ready = [self.held] if self.held is not None else []
        self.received.extend(response.token_ids)
        self.held = response if response.finish_reason == pb.FINISH_REASON_ABORT else None
        if self.held is None:
            ready.append(response)
        return ready

    def finish(self, trailing: Sequence[tuple[str, str]] | None) -> tuple[float | None, list[pb.GenerateResponse]]:
        """At a stream's normal end: seconds to wait before resending (None: the stream is over) and the responses
        still to hand over; a drained stream's last piece goes without its ABORT, continued by the resend."""
        held, self.held = self.held, None
        delay = self.drained_delay(held, trailing)
        if delay is None:
            return None, [held] if held is not None else []
        return delay, continued(held)

    def retry_delay(self, error: grpc.RpcError) -> tuple[float | None, list[pb.GenerateResponse]]:
        """After ``error``: seconds to wait before resending (None to raise it: not UNAVAILABLE, resends used up,
        or the deadline would pass) and the responses still to hand over (an ABORT held back, without its finish:
        the resend carries on after its tokens)."""
        held, self.held = self.held, None
        delay = self._next_delay() if error.code() == grpc.StatusCode.UNAVAILABLE else None
        return delay, [] if delay is None or held is None else continued(held)

    def drained_delay(self, last: pb.GenerateResponse | None,
                      trailing: Sequence[tuple[str, str]] | None) -> float | None:
        """After a stream that ended normally: seconds to wait before resending, when the server ended it with
        ABORT because it shut down (its trailing metadata says so); else None, the stream is over."""
        if not self.resume_drained or last is None or last.finish_reason != pb.FINISH_REASON_ABORT:
            return None
        return self._next_delay() if (DRAINED_KEY, "true") in tuple(trailing or ()) else None

    def _next_delay(self) -> float | None:
        if self.resumes >= self.max_resumes:
            return None
        delay = min(FIRST_DELAY_S * 2**self.resumes, MAX_DELAY_S)
        left = self.remaining_s()
        if left is not None and left <= delay:
            return None
        self.resumes += 1
        return delay
