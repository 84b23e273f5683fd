"""LoRA benchmark (issue 43's goals), base model and adapters side by side in one run.

* uniform: N requests of `--input-len` random prompt tokens and `--output-len` greedy tokens (ignore_eos), all at
  once; first on the base model, then with the requests spread round-robin over `--num-adapters` rank-`--rank`
  adapters on all seven projections. Output tok/s of each and their ratio.
* batch 1: one request (same lengths), without and with an adapter; decode tok/s and the ratio.
* load: an adapter the engine has never seen, loaded at run time (`LLM.add_lora`, a round trip to the engine core
  and its worker) and then used by a 1-token request; the load time, and the first use's extra time over a second
  1-token request with it (its slot filled on first use): their sum is the time from load to first use.

The adapters are written here in PEFT's format (adapter_config.json + adapter_model.safetensors) with random signed A
and B, for the model's own shapes (read from its config), under --adapter-dir. pagedllm's engine flags are `pagedllm
serve`'s; `--enable-lora`, `--max-loras` and `--max-lora-rank` are set from --num-adapters and --rank.

Usage: python bench/lora.py [--model M] [--num-prompts 64] [--input-len 128] [--output-len 128] [--rank 16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time

import numpy as np

PROJECTIONS = {
    "self_attn.q_proj": ("hidden", "q"),
    "self_attn.k_proj": ("hidden", "kv"),
    "self_attn.v_proj": ("hidden", "kv"),
    "self_attn.o_proj": ("q", "hidden"),
    "mlp.gate_proj": ("hidden", "inter"),
    "mlp.up_proj": ("hidden", "inter"),
    "mlp.down_proj": ("inter", "hidden"),
}


def write_adapter(folder: str, hf_config, rank: int, seed: int, std: float = 0.15) -> str:
    """A PEFT-format adapter of `rank` on every projection of every layer, random signed A and B."""
    import torch
    from safetensors.torch import save_file

    if os.path.isfile(os.path.join(folder, "adapter_model.safetensors")):
        return folder
    os.makedirs(folder, exist_ok=True)
    c = hf_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    width = {
        "hidden": c.hidden_size,
        "q": c.num_attention_heads * head_dim,
        "kv": c.num_key_value_heads * head_dim,
        "inter": c.intermediate_size,
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c.num_hidden_layers):
        for proj, (fan_in, fan_out) in PROJECTIONS.items():
            name = f"base_model.model.model.layers.{layer}.{proj}"
            a = torch.randn(rank, width[fan_in], generator=gen) * (std * 4 / width[fan_in] ** 0.5)
            b = torch.randn(width[fan_out], rank, generator=gen) * (std * 4 / rank**0.5)
            tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"] = a, b
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": rank,
        "target_modules": [p.split(".")[1] for p in PROJECTIONS],
        "bias": "none",
    }
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return folder


def main(argv: list[str] | None = None) -> int:
    from pagedllm import LLM, LoRARequest, SamplingParams
    from pagedllm.config import cache_dir
    from pagedllm.engine.arg_utils import EngineArgs

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1, help="uniform runs of each kind, best kept")
    parser.add_argument("--rounds-b1", type=int, default=5, help="batch-1 runs of each kind, alternating, best kept")
    parser.add_argument("--adapter-dir", default=os.path.join(cache_dir(), "bench", "lora"))
    parser.add_argument("--json-out", default=None)
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.enable_lora = True
    engine_args.max_loras = max(args.num_adapters, 1)
    engine_args.max_lora_rank = args.rank
    kwargs = {k: v for k, v in vars(engine_args).items() if k != "model"}
    llm = LLM(engine_args.model, **kwargs)
    hf_config = llm.config.model_config.hf_config
    name = os.path.basename(llm.config.model_config.model)
    folders = [
        write_adapter(os.path.join(args.adapter_dir, f"{name}-r{args.rank}-{i}"), hf_config, args.rank, seed=i)
        for i in range(args.num_adapters + 1)
    ]
    loras = [LoRARequest(f"a{i}", i + 1, f) for i, f in enumerate(folders[:-1])]
    rng = np.random.default_rng(0)
    vocab = llm.config.model_config.vocab_size
    prompts = [rng.integers(100, vocab - 100, args.input_len).tolist() for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    for lora in loras:
        llm.add_lora(lora)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False, lora_request=loras[:2])

    def uniform(with_loras: bool) -> float:
        best = 0.0
        for _ in range(args.rounds):
            llm.reset_prefix_cache()
            spread = [loras[i % len(loras)] for i in range(len(prompts))] if with_loras else None
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=spread)
            dt = time.perf_counter() - t0
            assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
            best = max(best, len(prompts) * args.output_len / dt)
        return best

    def batch1(lora) -> float:
        """Decode tok/s of one request: (output_len - 1) tokens over the full run minus its first token's time."""
        llm.reset_prefix_cache()
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts[:1], one, use_tqdm=False, lora_request=lora)
        t1 = time.perf_counter()
        llm.reset_prefix_cache()
        llm.generate(prompts[:1], params, use_tqdm=False, lora_request=lora)
        t2 = time.perf_counter()
        return (args.output_len - 1) / ((t2 - t1) - (t1 - t0))

    base_tps = uniform(False)
    lora_tps = uniform(True)
    # Batch 1, base and adapter alternating (this VM's speed drifts), the best of --rounds-b1 each.
    base_b1 = lora_b1 = 0.0
    for _ in range(args.rounds_b1):
        base_b1 = max(base_b1, batch1(None))
        lora_b1 = max(lora_b1, batch1(loras[0]))
    # Load at run time, then the first use against a second use.
    fresh = LoRARequest("fresh", len(loras) + 1, folders[-1])
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    llm.add_lora(fresh)
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate(prompts[-1:], one, use_tqdm=False, lora_request=fresh)
    t_first = time.perf_counter() - t0
    llm.reset_prefix_cache()
    seconds = []
    for _ in range(3):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        llm.generate(prompts[-1:], one, use_tqdm=False, lora_request=fresh)
        seconds.append(time.perf_counter() - t0)
    t_again = statistics.median(seconds)
    llm.shutdown()
    result = {
        "model": name,
        "cpu": platform.processor() or platform.machine(),
        "command": "python bench/lora.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "uniform_base_tok_s": round(base_tps, 1),
        "uniform_lora_tok_s": round(lora_tps, 1),
        "uniform_ratio": round(lora_tps / base_tps, 3),
        "batch1_base_tok_s": round(base_b1, 1),
        "batch1_lora_tok_s": round(lora_b1, 1),
        "batch1_ratio": round(lora_b1 / base_b1, 3),
        "load_ms": round(t_load * 1e3, 1),
        "first_use_extra_ms": round((t_first - t_again) * 1e3, 1),
        "load_to_first_use_ms": round((t_load + t_first - t_again) * 1e3, 1),
    }
    print(json.dumps(result, indent=1))
    if args.json_out:
        with open(args.json_out, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
