"""The CPU's own kernels and settings: building the C kernels in csrc/, choosing C or torch per shape by measurement,
the fused ops, the C decode stack, malloc and OpenMP settings.
"""
