"""The attention backends: `torch` (torch_sdpa.py, device-agnostic, the reference) and `cpu_native` (cpu_native.py,
the C++ kernels). Each names its metadata builder and its forward; base.py holds what they share."""
