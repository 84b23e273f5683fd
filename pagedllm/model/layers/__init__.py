"""pagedllm.model.layers."""
