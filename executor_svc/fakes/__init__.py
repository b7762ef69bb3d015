"""Model-free executors for tests and benchmarks: the shadow-KV oracle, the null executor and the simulated
accelerator.
"""
