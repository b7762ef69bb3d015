"""The ``vllm.grpc.engine.VllmEngine`` service: gateways' router -> worker protocol, translated to and from the shared
frontend (requests in, responses out, the info RPCs, the servicer)."""
