"""The rope scalings transformers evaluates from the current sequence length, fixed once by the engine's max_model_len
(pagedllm/model/layers/rotary.py), against transformers' own computation:
  - longrope (Phi-3): the long factors when max_model_len passes the original context, the short ones otherwise,
    frequencies and attention factor as `_compute_longrope_parameters` gives them for a sequence on the same side;
    a tiny Phi-3 served past its original context greedy-identical to HF on prompts longer than that context (where
    transformers uses the long factors too; the short-factor side is the phi3-longrope-partial variant of
    test_tiny_models);
  - dynamic NTK: the frequencies for a max_model_len past max_position_embeddings as `_compute_dynamic_ntk_parameters`
    gives them at that length, unscaled up to it; a tiny Llama with dynamic scaling served within its context
    greedy-identical to HF; the engine accepts max_model_len up to max_position_embeddings * factor, no further;
  - an unknown scaling type is a ValueError naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model.config_loader import load_model_config
from pagedllm.model.layers.rotary import RotaryEmbedding, rope_inv_freq
from tests.model_utils import PHI3_LONGROPE_32, hf_greedy, make_tiny_model, random_prompts

MAX_TOKENS = 12
ENGINE: dict[str, Any] = dict(dtype="float32", num_threads=1, kv_cache_memory_bytes="8MiB", engine_client="inproc")
# Phi-3 with LongRoPE over half of each head, an original context of 32 in 512 (attention factor from 16)
PHI3_SHORT_CONTEXT: dict[str, Any] = dict(seed=23, num_hidden_layers=2, **PHI3_LONGROPE_32)
# Llama with dynamic NTK scaling by 4 over a 256-token context
LLAMA_DYNAMIC: dict[str, Any] = dict(
    seed=24, num_hidden_layers=2, max_position_embeddings=256, rope_scaling={"rope_type": "dynamic", "factor": 4.0}
)


def _hf_config(folder: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, local_files_only=True)


def _greedy(folder: str, prompts: list[list[int]], max_model_len: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(folder, **ENGINE, max_model_len=max_model_len) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("max_model_len", [16, 32, 33, 256])
def test_longrope_factors_follow_max_model_len(tiny_model_dir: Path, max_model_len: int) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _hf_config(make_tiny_model(tiny_model_dir, "Phi3ForCausalLM", **PHI3_SHORT_CONTEXT))
    # transformers' frequencies for a sequence on the same side of the original context (32) as max_model_len
    want, want_factor = ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=max_model_len)
    theta = config.rope_parameters["rope_theta"]
    got, factor = rope_inv_freq(8, theta, config.rope_parameters, config.max_position_embeddings, max_model_len)
    torch.testing.assert_close(got.float(), want, rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor, rel=1e-12) and factor > 1.0
    if max_model_len > 32:  # the long factors, not the short ones
        short, _ = ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=None)
        assert not torch.allclose(got.float(), short)


def test_longrope_past_the_original_context_matches_hf(tiny_model_dir: Path) -> None:
    """max_model_len 256 over an original context of 32: the long factors, as transformers on longer prompts."""
    folder = make_tiny_model(tiny_model_dir, "Phi3ForCausalLM", **PHI3_SHORT_CONTEXT)
    prompts = random_prompts([33, 47, 90], seed=60)
    assert _greedy(folder, prompts, 256) == hf_greedy(folder, prompts, MAX_TOKENS)


@pytest.mark.parametrize("max_model_len", [100, 256, 257, 700, 1024])
def test_dynamic_ntk_frequencies_at_max_model_len(tiny_model_dir: Path, max_model_len: int) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _hf_config(make_tiny_model(tiny_model_dir, "LlamaForCausalLM", **LLAMA_DYNAMIC))
    want, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, seq_len=max_model_len)
    theta = config.rope_parameters["rope_theta"]
    got, factor = rope_inv_freq(16, theta, config.rope_parameters, 256, max_model_len)
    torch.testing.assert_close(got.float(), want, rtol=1e-6, atol=0)
    assert factor == 1.0
    unscaled, _ = rope_inv_freq(16, theta, None, 256)
    assert torch.equal(got, unscaled) == (max_model_len <= 256)
    # the table covers every position the engine can reach
    table = RotaryEmbedding(16, 256, theta, config.rope_parameters, max_model_len=max_model_len).cos_sin_cache
    assert table.shape == (max(256, max_model_len), 16)


def test_dynamic_ntk_within_the_context_matches_hf(tiny_model_dir: Path) -> None:
    folder = make_tiny_model(tiny_model_dir, "LlamaForCausalLM", **LLAMA_DYNAMIC)
    prompts = random_prompts([5, 60, 200], seed=61)
    assert _greedy(folder, prompts, 256) == hf_greedy(folder, prompts, MAX_TOKENS)


def test_dynamic_ntk_max_model_len_limit(tiny_model_dir: Path) -> None:
    folder = make_tiny_model(tiny_model_dir, "LlamaForCausalLM", **LLAMA_DYNAMIC)
    assert load_model_config(folder).max_model_len == 256  # by default the unscaled context
    assert load_model_config(folder, max_model_len=1024).max_model_len == 1024
    with pytest.raises(ValueError, match="max_model_len 1025 must be between 1 and the model's limit 1024"):
        load_model_config(folder, max_model_len=1025)


def test_unknown_scaling_type_is_named() -> None:
    with pytest.raises(ValueError, match="unsupported rope scaling type 'su-perb'"):
        RotaryEmbedding(16, 64, 10000.0, {"rope_type": "su-perb", "factor": 2.0})
