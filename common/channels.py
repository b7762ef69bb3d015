"""gRPC message-size, keepalive and port options, one place for both ends of each hop."""

from __future__ import annotations

# The executor hop carries whole prompts and, for logprobs, top-n tables of every sequence of a step.
EXECUTOR_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# The public API's default largest message, each way (``--max-message-bytes``, the client's ``max_message_bytes``).
PUBLIC_MAX_MESSAGE_BYTES = 16 << 20
# gRPC's channel arguments are C ints: a larger message bound fails when the server is built (OverflowError).
GRPC_MAX_MESSAGE_BYTES = (1 << 31) - 1

GrpcOptions = list[tuple[str, int]]
# Trailing-metadata key of a Generate stream a scheduler ended with ABORT because it shut down: a client that
# resumes streams sends the request again elsewhere, with the tokens it has.
DRAINED_KEY = "nanoserve-drained"


def message_size_options(max_bytes: int) -> GrpcOptions:
    """Both directions bounded by ``max_bytes``."""
    return [("grpc.max_receive_message_length", max_bytes), ("grpc.max_send_message_length", max_bytes)]


def server_options(max_bytes: int) -> GrpcOptions:
    """A service's server: messages bounded by ``max_bytes``, and its port its own.

    gRPC sets SO_REUSEPORT on Linux unless told not to: a second executor or scheduler started on a port in use
    then served beside the first, each taking some of the connections, instead of failing to bind.
    """
    return [*message_size_options(max_bytes), ("grpc.so_reuseport", 0)]


EXECUTOR_SERVER_OPTIONS: GrpcOptions = server_options(EXECUTOR_MAX_MESSAGE_BYTES)
# The scheduler's channel to its executor pings it, so a peer that vanished without a FIN is noticed in seconds.
EXECUTOR_CHANNEL_OPTIONS: GrpcOptions = [
    *message_size_options(EXECUTOR_MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


def public_channel_options(max_bytes: int = PUBLIC_MAX_MESSAGE_BYTES) -> GrpcOptions:
    """A client's channel to the public API: keepalive pings that a long, quiet stream survives."""
    return [("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000), *message_size_options(max_bytes)]
