"""Cross-origin calls from browsers (a web UI served from another origin), as vLLM's ``--allowed-origins``,
``--allowed-credentials``, ``--allowed-methods`` and ``--allowed-headers`` allow them."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware


@dataclass(frozen=True)
class Cors:
    """What a page of another origin may call; vLLM's defaults: any origin, method and header, no credentials."""

    origins: tuple[str, ...] = ("*",)
    credentials: bool = False
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)

    def install(self, app: FastAPI) -> None:
        """Outermost: a browser's preflight carries no API key, and a refusal (a 401) must still be readable."""
        app.add_middleware(CORSMiddleware, allow_origins=list(self.origins), allow_credentials=self.credentials,
                           allow_methods=list(self.methods), allow_headers=list(self.headers))


# vLLM's defaults.
ANY_ORIGIN = Cors()
