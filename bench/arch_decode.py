"""Batch-1 decode of every architecture against Llama's of the same size: the fused decoder on each layer description.

    python bench/arch_decode.py [--rounds 3] [--output-len 128] [--num-threads 2] [--only llama mixtral ...]

Each architecture is a random model of one size (hidden 256, 6 layers, 8 query heads of 32 on 4 KV heads, MLP 768,
vocabulary 512; the architecture's own fields as the tiny-model tests set them), built by the tests' own builder
(tests/model_utils.py) under ~/.cache/pagedllm/bench/arch-decode. Per architecture, in process (engine_client=inproc,
float32): one request of 64 random prompt tokens decoding `output-len` tokens greedily (ignore_eos), and one decoding
1; decode tok/s = (output_len - 1) / (median full - median one) over `rounds` runs each, the architectures in turn
round by round. Also whether its decode ran in the fused decoder. The goal of the architectures issue: every
architecture within 15% of Llama's tok/s. Prints a markdown table; nothing here is part of CI.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

SIZE = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    initializer_range=0.05,
)
GEMMA_TYPES = ["sliding_attention", "full_attention"] * 3
ARCHS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaForCausalLM", {}),
    "mistral (window 32)": ("MistralForCausalLM", dict(sliding_window=32)),
    "qwen2 (qkv bias)": ("Qwen2ForCausalLM", {}),
    "qwen3 (q/k norm)": ("Qwen3ForCausalLM", {}),
    "gemma": ("GemmaForCausalLM", dict(tie_word_embeddings=True)),
    "gemma2 (soft-caps)": (
        "Gemma2ForCausalLM",
        dict(tie_word_embeddings=True, sliding_window=32, query_pre_attn_scalar=32, layer_types=GEMMA_TYPES),
    ),
    "gemma3": (
        "Gemma3ForCausalLM",
        dict(tie_word_embeddings=True, sliding_window=32, query_pre_attn_scalar=32, layer_types=GEMMA_TYPES),
    ),
    "granite (multipliers)": (
        "GraniteForCausalLM",
        dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=0.5),
    ),
    "olmo2 (post norms, full q/k norms)": ("Olmo2ForCausalLM", {}),
    "smollm3 (no-rope layers)": ("SmolLM3ForCausalLM", dict(no_rope_layers=[1, 1, 1, 0, 1, 1])),
    "stablelm (LayerNorm, partial rotary)": ("StableLmForCausalLM", dict(partial_rotary_factor=0.25)),
    "starcoder2 (LayerNorm, plain MLP)": ("Starcoder2ForCausalLM", dict(tie_word_embeddings=True)),
    "phi2 (parallel, plain MLP)": ("PhiForCausalLM", dict(partial_rotary_factor=0.4)),
    "phi3 (fused qkv, gate_up)": ("Phi3ForCausalLM", {}),
    # Mixture of experts (issue 41): 8 experts of a quarter of the dense MLP's width, 2 a token (the MLP bytes a token
    # reads are half the dense model's)
    "mixtral (8 experts, top 2)": (
        "MixtralForCausalLM",
        dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=192),
    ),
    "qwen3-moe (8 experts, top 2)": (
        "Qwen3MoeForCausalLM",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=192, norm_topk_prob=True),
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--only", nargs="+", help="architectures whose name starts with one of these (and llama)")
    args = parser.parse_args()

    import torch

    from pagedllm import LLM, SamplingParams
    from tests.model_utils import make_tiny_model

    root = os.path.expanduser("~/.cache/pagedllm/bench/arch-decode")
    torch.manual_seed(0)
    prompt = torch.randint(3, 500, (64,)).tolist()
    full = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llms = {}
    for name, (arch, fields) in ARCHS.items():
        if args.only and name != "llama" and not any(name.startswith(o) for o in args.only):
            continue
        folder = make_tiny_model(root, arch, seed=1, **{**SIZE, **fields})
        llm = LLM(folder, engine_client="inproc", dtype="float32", num_threads=args.num_threads, max_model_len=512)
        fused = llm.engine_core.engine_core.executor.worker.model_runner.decode_runner is not None
        llms[name] = (llm, fused, [], [])
    request = [{"prompt_token_ids": prompt}]
    for _ in range(args.rounds):
        for llm, _, fulls, ones in llms.values():
            for params, times in ((one, ones), (full, fulls)):
                start = time.perf_counter()
                llm.generate(request, params, use_tqdm=False)
                times.append(time.perf_counter() - start)
    rate = {}
    for name, (_, _, fulls, ones) in llms.items():
        rate[name] = (args.output_len - 1) / (statistics.median(fulls) - statistics.median(ones))
    base = rate["llama"]
    print("| architecture | decode | tok/s | of Llama's |")
    print("|---|---|---|---|")
    for name, (_, fused, _, _) in llms.items():
        print(f"| {name} | {'fused' if fused else 'layer path'} | {rate[name]:.0f} | {rate[name] / base:.2f}x |")


if __name__ == "__main__":
    main()
