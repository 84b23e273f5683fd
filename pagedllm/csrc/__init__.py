"""The native kernels' sources (csrc/cpu/*.cpp, *.h), built by the install (setup.py) into pagedllm/_C and one
shared library per instruction set, pagedllm/_cpu_<isa>."""
