"""pagedllm.model.models."""
