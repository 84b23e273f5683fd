"""Shared test helpers: tiny random HF models built on the fly, and HF transformers as the reference.

`make_tiny_model` writes an HF folder (config.json, model.safetensors, a WordLevel tokenizer whose vocabulary
is exactly the model's) that both `pagedllm.LLM` and transformers load. Every parameter is redrawn from a
seeded generator with a larger scale than HF's init (norm weights around 1, biases non-zero), so that greedy
outputs vary from token to token and a wrong weight, bias or norm changes the result. Built folders and
loaded HF models are cached per process, keyed on their arguments, so a test session builds each once.

`hf_greedy` and `hf_logprobs` are the float32 references (eager attention) the engine is compared with.
`PreemptionCounter` sums the scheduler's per-step `num_preemptions` stats seen by an `LLM`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2; "</s>" is the eos token
FIRST_REGULAR_ID = len(SPECIAL_TOKENS)

# Small but real shapes: GQA (4 query heads over 2 KV heads), several layers.
_BASE_CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma2ForCausalLM": "gemma2",
    "SmolLM3ForCausalLM": "smollm3",
    "GraniteForCausalLM": "granite",
    "Olmo2ForCausalLM": "olmo2",
    "GemmaForCausalLM": "gemma",
    "Starcoder2ForCausalLM": "starcoder2",
    "StableLmForCausalLM": "stablelm",
    "PhiForCausalLM": "phi",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "GptOssForCausalLM": "gpt_oss",
}

# Phi-3 LongRoPE over half of each head with an original context of 32 tokens (past it, the long factors)
PHI3_LONGROPE_32: dict[str, Any] = dict(
    partial_rotary_factor=0.5,
    original_max_position_embeddings=32,
    rope_scaling={
        "rope_type": "longrope",
        "short_factor": [1.0, 1.2, 1.9, 3.1],
        "long_factor": [1.4, 3.5, 8.0, 17.0],
        "original_max_position_embeddings": 32,
    },
)
# Phi-3 LongRoPE over the first half of each head (4 frequencies), original context 256 of 512
PHI3_LONGROPE: dict[str, Any] = dict(
    partial_rotary_factor=0.5,
    original_max_position_embeddings=256,  # Phi3Config's own field, which transformers copies into the rope dict
    rope_scaling={
        "rope_type": "longrope",
        "short_factor": [1.0, 1.3, 2.1, 3.7],
        "long_factor": [1.5, 4.0, 9.0, 20.0],
        "original_max_position_embeddings": 256,
    },
)

_built: dict[str, str] = {}  # cache key -> folder
_hf_models: dict[str, Any] = {}  # folder -> loaded HF model
_hf_greedy_cache: dict[tuple[str, tuple[int, ...], int], list[int]] = {}


def _cache_key(arch: str, tie: bool, rope_scaling: dict | None, seed: int, overrides: dict[str, Any]) -> str:
    blob = json.dumps([arch, tie, rope_scaling, seed, overrides], sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def _randomize_(model: torch.nn.Module, seed: int, std: float) -> None:
    """Redraw every parameter: matrices N(0, std), biases N(0, std), norm weights U(0.5, 1.5)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied weights appear once
            if "norm" in name:
                new = torch.rand(param.shape, generator=gen) + 0.5
            else:
                new = torch.randn(param.shape, generator=gen) * std
            param.copy_(new.to(param.dtype))


def _save_tokenizer(folder: str, vocab_size: int) -> None:
    """A WordLevel tokenizer over "<unk> <s> </s> t3 ... t{vocab-1}": exactly the model's vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"t{i}": i for i in range(FIRST_REGULAR_ID, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<unk>"
    )
    assert len(fast) == vocab_size
    fast.save_pretrained(folder)


def _to_legacy_rope_keys(folder: str) -> None:
    """Rewrite config.json the transformers-4 way: top-level rope_theta, scaling under rope_scaling."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    params = dict(cfg.pop("rope_parameters", None) or {})
    cfg["rope_theta"] = params.pop("rope_theta", 10000.0)
    if params.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = params
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


def make_tiny_model(
    tmp_dir: str | os.PathLike[str],
    arch: str,
    *,
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    seed: int = 0,
    legacy_rope_keys: bool = False,
    **overrides: Any,
) -> str:
    """Build (or reuse) a tiny random `arch` model with its tokenizer under `tmp_dir`; returns the folder.

    `rope_scaling` (e.g. llama3) goes into `rope_parameters` together with `rope_theta` (an override, default
    10000). `legacy_rope_keys` writes them as top-level `rope_theta` + `rope_scaling` instead, as older
    transformers did. Other overrides replace config fields (num_hidden_layers, head_dim, ...).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch not in _MODEL_TYPES:
        raise ValueError(f"unknown architecture {arch!r}; one of {sorted(_MODEL_TYPES)}")
    key = _cache_key(arch, tie_word_embeddings, rope_scaling, seed, {**overrides, "legacy": legacy_rope_keys})
    folder = os.path.join(os.fspath(tmp_dir), f"{_MODEL_TYPES[arch]}-{key}")
    if key in _built and os.path.isfile(os.path.join(folder, "config.json")):
        return folder

    fields = {**_BASE_CONFIG, **overrides}
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(fields.pop("rope_theta", 10000.0))}
    if rope_scaling:
        rope.update(rope_scaling)
    if arch == "Gemma3ForCausalLM":  # rope per layer kind: global layers take rope_theta (and the scaling)
        local = {"rope_type": "default", "rope_theta": float(fields.pop("rope_local_base_freq", 10000.0))}
        rope = {"full_attention": rope, "sliding_attention": local}
    config = AutoConfig.for_model(
        _MODEL_TYPES[arch],
        architectures=[arch],
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters=rope,
        dtype="float32",
        **fields,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    _randomize_(model, seed, float(fields["initializer_range"]))
    if tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    model.save_pretrained(folder, safe_serialization=True)
    _save_tokenizer(folder, int(fields["vocab_size"]))
    if legacy_rope_keys:
        _to_legacy_rope_keys(folder)
    _built[key] = folder
    return folder


def load_hf_model(folder: str) -> Any:
    """The HF model of a folder in float32 with eager attention (and eager experts) (cached per folder)."""
    from transformers import AutoModelForCausalLM

    if folder not in _hf_models:
        with open(os.path.join(folder, "config.json")) as f:
            moe = "num_experts_per_tok" in json.load(f)
        # experts as the modeling file's own loop adds them (ascending expert id), not the grouped-GEMM default
        extra = {"experts_implementation": "eager"} if moe else {}
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="eager", local_files_only=True, **extra
        )
        _hf_models[folder] = model.eval()
    return _hf_models[folder]


def hf_greedy(folder: str, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuation of each prompt by HF `generate`, one prompt at a time, exactly max_new_tokens.

    Results are cached per (folder, prompt, max_new_tokens), so tests may ask for the same prompts again.

    EOS is disabled (eos_token_id=None) rather than suppressed (min_new_tokens would mask its logit), which
    matches the engine's `ignore_eos=True`: EOS may be generated and generation continues past it.
    """
    from transformers import GenerationConfig

    model = load_hf_model(folder)
    # generate() fills unset fields from the model's generation_config (eos 2): clear eos there too.
    model.generation_config.eos_token_id = None
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            key = (folder, tuple(prompt), max_new_tokens)
            if key not in _hf_greedy_cache:
                ids = torch.tensor([list(prompt)], dtype=torch.long)
                seq = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_config)
                new = seq[0, ids.shape[1] :].tolist()
                assert len(new) == max_new_tokens, f"HF stopped after {len(new)} of {max_new_tokens} tokens"
                _hf_greedy_cache[key] = new
            outs.append(list(_hf_greedy_cache[key]))
    return outs


def hf_logprobs(folder: str, token_ids: Sequence[int]) -> torch.Tensor:
    """[len(token_ids), vocab] float32 log_softmax of HF's logits: row i is the distribution of token i+1."""
    model = load_hf_model(folder)
    with torch.inference_mode():
        logits = model(torch.tensor([list(token_ids)], dtype=torch.long)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def hf_prompt_logprobs(folder: str, prompt: Sequence[int]) -> torch.Tensor:
    """HF log-probabilities over a prompt (same as `hf_logprobs`; name used by the prompt-logprobs tests)."""
    return hf_logprobs(folder, prompt)


def random_prompts(lengths: Sequence[int], seed: int, vocab_size: int = VOCAB_SIZE) -> list[list[int]]:
    """Random token ids (never the special tokens) of the given lengths, from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(FIRST_REGULAR_ID, vocab_size, (n,), generator=gen).tolist() for n in lengths]


class PreemptionCounter:
    """Counts preemptions an LLM's engine reports: wraps its client's `get_output` and sums the
    `scheduler_stats.num_preemptions` of every step (the scheduler resets that counter at each report).

    Use as a context manager around `llm.generate(...)`; works for any client that returns EngineCoreOutputs.
    """

    def __init__(self, llm: Any) -> None:
        self.client = llm.engine_core
        self.num_preemptions = 0
        self.num_steps = 0
        self._orig = None

    def __enter__(self) -> PreemptionCounter:
        self._orig = self.client.get_output

        def get_output(*args: Any, **kwargs: Any) -> Any:
            outputs = self._orig(*args, **kwargs)
            stats = getattr(outputs, "scheduler_stats", None)
            if stats is not None:
                self.num_preemptions += int(stats.num_preemptions)
                self.num_steps += 1
            return outputs

        self.client.get_output = get_output
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.client.get_output  # back to the class method


class _RowsInCache:
    """Tokens of several requests (request i: `rows` consecutive tokens from position `first`, each request with its
    own blocks from block 3 on in each KV cache group, and a random context in them), set up in an in-process
    engine's KV cache for a direct call of the fused decoder or the layer path; the cache is restored on exit.
    `reset()` puts the random context back (undoing what a call wrote)."""

    def __init__(self, llm: Any, requests: list[tuple[int, int]]) -> None:
        self.runner = runner = llm.engine_core.engine_core.executor.worker.model_runner
        self.requests = requests
        block = runner.block_size
        self.caches = [layer.self_attn.attn.kv_cache for layer in runner.model.model.layers]
        groups = runner.kv_layout.num_groups
        width = max(-(-(first + rows) // block) for first, rows in requests)
        self.table = torch.zeros(groups, len(requests), width, dtype=torch.int64)
        next_block = 3
        for grp in range(groups):
            for i, (first, rows) in enumerate(requests):
                n = -(-(first + rows) // block)
                self.table[grp, i, :n] = torch.arange(next_block, next_block + n)
                next_block += n
        self.blocks = range(3, next_block)
        self.positions = torch.cat([torch.arange(first, first + rows) for first, rows in requests])
        self.table_rows = torch.cat([torch.full((rows,), i, dtype=torch.int64) for i, (_, rows) in enumerate(requests)])
        pos = self.positions
        self.slots = self.table[:, self.table_rows, pos // block] * block + pos % block  # [groups, R]
        self.ids = torch.randint(runner.vocab_size, (pos.numel(),), generator=torch.Generator().manual_seed(6))

    def __enter__(self) -> _RowsInCache:
        self.saved = [(k.clone(), v.clone()) for k, v in self.caches]
        g = torch.Generator().manual_seed(5)
        for k, v in {id(c[0]): c for c in self.caches}.values():  # a context to attend to in the blocks used
            for blk in self.blocks:
                k[blk].copy_(torch.randn(k[blk].shape, generator=g))
                v[blk].copy_(torch.randn(v[blk].shape, generator=g))
        self.context = [(k.clone(), v.clone()) for k, v in self.caches]
        return self

    def reset(self) -> None:
        for (k, v), (k0, v0) in zip(self.caches, self.context):
            k.copy_(k0)
            v.copy_(v0)

    def cache_now(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(k.clone(), v.clone()) for k, v in self.caches]

    def __exit__(self, *exc: Any) -> None:
        for (k, v), (k0, v0) in zip(self.caches, self.saved):
            k.copy_(k0)
            v.copy_(v0)

    def fused(self) -> torch.Tensor:
        return self.runner.decode_runner(self.ids, self.positions, self.slots, self.table, self.table_rows)

    def layer_path(self) -> torch.Tensor:
        """The same rows through the model's forward (the layer path), every row a generated token."""
        from pagedllm.model.attention.backends.base import CommonAttentionMetadata
        from pagedllm.model.layers.linear import GENERATED_ROWS
        from pagedllm.model.step_plan import StepPlan

        runner = self.runner
        lens = np.array([rows for _, rows in self.requests], dtype=np.int64)
        order = np.argsort(lens != 1, kind="stable")  # decodes first, as the runner lays a step out
        assert np.array_equal(order, np.arange(len(order))), "list single-row requests first"
        cu = np.concatenate([[0], np.cumsum(lens)])
        starts = np.array([first for first, _ in self.requests], dtype=np.int64)
        reqs = np.arange(len(self.requests))
        metas = [
            runner.attn_backend.build_metadata(
                CommonAttentionMetadata(
                    int((lens == 1).sum()),
                    cu,
                    starts,
                    self.slots[g].numpy(),
                    self.table[g].numpy(),
                    reqs,
                    runner.block_size,
                ),  # fmt: skip
                runner.device,
            )
            for g in range(self.table.shape[0])
        ]
        plan = StepPlan(self.positions, metas[0] if len(metas) == 1 else metas, GENERATED_ROWS)
        return runner.model(self.ids, plan)


def check_fused_rows_are_lone_tokens(llm: Any, requests: list[tuple[int, int]]) -> None:
    """Runs tokens of several requests (request i: `rows` consecutive tokens from position `first`, each with its own
    blocks and a random context in them) through an in-process engine's fused decoder at once, then each token alone,
    and asserts the same hidden states and KV cache contents, bit for bit. The cache is restored afterwards."""
    with _RowsInCache(llm, requests) as rows:
        together = rows.fused()
        after_together = rows.cache_now()
        rows.reset()
        one = torch.tensor([0])
        alone = [
            rows.runner.decode_runner(
                rows.ids[r : r + 1],
                rows.positions[r : r + 1],
                rows.slots[:, r : r + 1].contiguous(),
                rows.table[:, rows.table_rows[r]][:, None].contiguous(),
                one,
            )  # fmt: skip
            for r in range(rows.positions.numel())
        ]
        assert torch.equal(together, torch.cat(alone))
        for (k, v), (ka, va) in zip(rows.caches, after_together):
            assert torch.equal(k, ka) and torch.equal(v, va)


def check_fused_matches_layer_path(llm: Any, requests: list[tuple[int, int]]) -> None:
    """The same rows (as check_fused_rows_are_lone_tokens lays them out) through the fused decoder and through the
    model's layer path: the same hidden states and KV cache contents, bit for bit."""
    with _RowsInCache(llm, requests) as rows:
        fused = rows.fused()
        after_fused = rows.cache_now()
        rows.reset()
        layered = rows.layer_path()
        for (k, v), (kf, vf) in zip(rows.caches, after_fused):
            assert torch.equal(k, kf) and torch.equal(v, vf)
        assert torch.equal(fused, layered), (fused - layered).abs().max()


class OracleProposer:
    """Drafts that are HF's own next tokens with every third one wrong: verifications that accept some drafts and
    reject others, whatever the tiny model writes (an n-gram proposer finds nothing to copy in random output)."""

    def __init__(self, prompts: list[list[int]], expected: list[list[int]]) -> None:
        self.full = {tuple(p): p + e for p, e in zip(prompts, expected)}
        self.calls = 0

    def propose(self, tokens: Any, k: int) -> list[int]:
        tokens = [int(t) for t in tokens]
        for prompt, full in self.full.items():
            if tokens[: len(prompt)] == list(prompt) and full[: len(tokens)] == tokens:
                drafts = full[len(tokens) : len(tokens) + k]
                self.calls += 1
                return [t if (i + self.calls) % 3 else (t + 1) % 500 for i, t in enumerate(drafts)]
        return []
