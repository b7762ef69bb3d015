"""The executor's core on plain types: the request table updated from plan deltas, the step pipeline, and the codec
that turns protobuf into those types at the edge.
"""
