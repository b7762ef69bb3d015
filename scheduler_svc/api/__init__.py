"""The public APIs: what both share (the frontend), requests in (prepare, structured output), the gRPC servicer
(grpc_service) with its responses out (codec), and the OpenAI HTTP API (http/). They only translate; the engine does
the work.
"""
