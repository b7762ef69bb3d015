"""The scheduler's pure core: sequences, KV blocks and the prefix cache, the scheduling policy, plans as deltas,
sampling parameters, validation, stop rules and output processing. Plain Python objects: no gRPC, no protobuf.
"""
