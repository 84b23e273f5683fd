"""Anthropic-compatible API (the Messages API), served beside the OpenAI one by the same server."""
