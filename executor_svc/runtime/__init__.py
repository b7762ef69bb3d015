"""Running a real model: the model executor and runner (CUDA graphs included), a step's packed input, loading weights,
the embedded model registry, the model's config and tensor parallelism.
"""
