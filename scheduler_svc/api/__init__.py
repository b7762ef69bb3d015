"""The public APIs: what they share (the frontend, server_info), requests in (prepare, structured output), the gRPC
servicer (grpc_service) with its responses out (codec), the gateways' VllmEngine service (vllm_engine/), the OpenAI
HTTP API (http/), and the prefix cache's events over ZMQ (kv_zmq). They only translate; the engine does the work.
"""
