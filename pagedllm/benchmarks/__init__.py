"""Benchmarks shipped with pagedllm (`pagedllm bench ...`); results live in bench/RESULTS.md."""
