"""The OpenAI-compatible HTTP API, served by the scheduler process beside gRPC (``--http-port``)."""
