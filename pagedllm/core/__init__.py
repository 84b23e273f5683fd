"""pagedllm.core."""
