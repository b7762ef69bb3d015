"""Python client and CLI for a nanoserve scheduler."""

from client.api import AsyncClient, Client
from client.errors import NanoserveError
from client.results import Chunk, Completion, TokenLogprob, Usage

__all__ = ["AsyncClient", "Chunk", "Client", "Completion", "NanoserveError", "TokenLogprob", "Usage"]
