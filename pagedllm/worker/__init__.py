"""pagedllm.worker."""
