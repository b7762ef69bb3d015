"""The engine and its loop: one thread drives the core and an executor step after step; admission, supervision of the
executor, stats and metrics, and the executor client (gRPC, translated by ``common.step_codec``).
"""
