"""Speculative decoding: the n-gram proposer, the per-request draft policy and the rejection sampler."""
