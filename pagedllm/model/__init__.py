"""pagedllm.model."""
