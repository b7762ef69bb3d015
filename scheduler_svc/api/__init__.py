"""The public APIs: what both share (the frontend), the gRPC servicer and its codec, and the OpenAI HTTP API (http/).
They only translate; the engine does the work.
"""
