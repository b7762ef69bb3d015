"""Code that more than one of ``client``, ``scheduler_svc`` and ``executor_svc`` needs.

It imports only ``nanoserve.v1`` (the protos) and third-party packages, never the
services or the client, so every arrow points into it (tests/test_package_arrows.py).
"""
