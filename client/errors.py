"""The one exception the client raises for anything the server refuses or cannot do."""

from __future__ import annotations

import grpc


class NanoserveError(Exception):
    """A failed call: ``code`` is the gRPC status code, ``message`` the server's explanation."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> NanoserveError:
        """Keep the status and the details of a grpc error, dropping the transport noise."""
        return cls(error.code(), error.details() or "")
