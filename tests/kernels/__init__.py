"""Kernels against their NumPy twins: numba (CPU) and CUDA (emulated), the KV cache dtypes."""
