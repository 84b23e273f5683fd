"""pagedllm.executor."""
