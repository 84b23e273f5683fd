"""pagedllm.engine."""
