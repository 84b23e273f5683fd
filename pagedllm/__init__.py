"""pagedllm: an LLM inference and serving engine with the architecture of vLLM V1."""
