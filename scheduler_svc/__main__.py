"""``nanoserve-scheduler`` / ``python -m scheduler_svc``: serve the public API in front of one executor."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from scheduler_svc.api.grpc_service import serve
from scheduler_svc.config import parse_config


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_config(argv)
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        asyncio.run(serve(config))
    except (ValueError, OSError) as e:  # an unreadable TLS file, a port in use: one clear line, no traceback
        logging.getLogger("nanoserve.scheduler").error("cannot serve: %s", e)
        sys.exit(1)


if __name__ == "__main__":
    main()
