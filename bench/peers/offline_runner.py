"""Run one offline workload on one engine and write its timings as JSON (one engine per process).

The peer harness (`run.py`) writes the workload (prompt token ids and output lengths) to a JSON file and starts
this script once per engine, each in its own interpreter: pagedllm and HF transformers from the project's
virtualenv, vLLM and llama.cpp from their own (`setup_vllm.sh`, `setup_llamacpp.sh`), so this file imports nothing
from pagedllm at module level.

    python offline_runner.py --engine {pagedllm,hf,vllm,llamacpp} --model DIR|FILE.gguf --workload W.json
                             --mode {throughput,decode} --out R.json [--num-iters N] [--num-threads 2]

llama.cpp runs through llama-cpp-python's bindings of llama.cpp's own C API (the `batched` example's loop): every
prompt's tokens go in batches of up to 512, each sequence with its own id in one unified KV cache, and then each
step decodes one token of every unfinished sequence in one `llama_decode`; the next token is the argmax of its
logits. At batch 1 that is llama.cpp's plain decode loop.

Every engine gets the same treatment: load (timed apart), one small untimed warm-up, then the timed calls.
throughput mode: all requests in one `generate` (HF: static batches of --hf-batch-size, as its users run it);
wall time of that call. decode mode (one request): a 1-token call ("ttft") and a full call, --num-iters times;
decode tok/s = (output_len - 1) / (median full - median ttft). Greedy (or sampled with --temperature and --top-p,
unseeded), ignore_eos; every request must produce exactly its requested number of tokens, which the result records.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

WARMUP = {"prompts": [list(range(1000, 1016)), list(range(2000, 2016))], "output_lens": [4, 4]}


class PagedLLMEngine:
    def __init__(self, model: str, num_threads: int, dtype: str = "float32", kv_cache_dtype: str = "auto") -> None:
        from pagedllm import LLM

        self.llm = LLM(
            model=model, num_threads=num_threads, dtype=dtype, kv_cache_dtype=kv_cache_dtype, max_model_len=2048
        )

    def generate(self, prompts: list[list[int]], output_lens: list[int], sampling: dict[str, Any]) -> list[list[int]]:
        from pagedllm import SamplingParams

        self.llm.reset_prefix_cache()  # no request may reuse an earlier call's KV
        params = [SamplingParams(max_tokens=n, ignore_eos=True, **sampling) for n in output_lens]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def close(self) -> None:
        self.llm.shutdown()


class VLLMEngine:
    def __init__(self, model: str, num_threads: int, dtype: str = "float32") -> None:
        from vllm import LLM

        # vLLM's CPU backend: KV cache size from VLLM_CPU_KVCACHE_SPACE (GiB; the harness sets 2, as pagedllm's
        # default), OpenMP threads pinned by VLLM_CPU_OMP_THREADS_BIND.
        self.llm = LLM(model=model, dtype=dtype, max_model_len=2048, gpu_memory_utilization=0.5, seed=0)

    def generate(self, prompts: list[list[int]], output_lens: list[int], sampling: dict[str, Any]) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.llm.reset_prefix_cache()
        params = [SamplingParams(max_tokens=n, ignore_eos=True, **sampling) for n in output_lens]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def close(self) -> None:
        del self.llm


class LlamaCppEngine:
    def __init__(self, model: str, num_threads: int, max_seqs: int = 64, n_ctx: int = 40960) -> None:
        import llama_cpp

        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(model.encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp cannot load {model}")
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, 512, 512, max_seqs
        cp.n_threads = cp.n_threads_batch = num_threads
        cp.kv_unified = True  # one cache shared by all sequences (else n_ctx is split evenly between them)
        cp.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.max_seqs = max_seqs
        self.batch = llama_cpp.llama_batch_init(512, 0, max_seqs)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        b = self.batch
        for k, (token, pos, seq, logits) in enumerate(entries):
            b.token[k], b.pos[k], b.n_seq_id[k], b.logits[k] = token, pos, 1, logits
            b.seq_id[k][0] = seq
        b.n_tokens = len(entries)
        if self.lib.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, k: int) -> int:
        import numpy as np

        logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, k), shape=(self.n_vocab,))
        return int(logits.argmax())

    def generate(self, prompts: list[list[int]], output_lens: list[int], sampling: dict[str, Any]) -> list[list[int]]:
        if sampling["temperature"] > 0:
            raise ValueError("the llama.cpp runner takes the argmax: greedy only")
        if len(prompts) > self.max_seqs:
            raise ValueError(f"at most {self.max_seqs} sequences")
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)  # no reuse of an earlier call's KV
        outs: list[list[int]] = [[] for _ in prompts]
        # Prefill: every prompt's tokens in batches of up to 512; logits at each prompt's last token.
        pending = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        for start in range(0, len(pending), 512):
            chunk = pending[start : start + 512]
            self._decode(chunk)
            for k, (_, _, seq, last) in enumerate(chunk):
                if last:
                    outs[seq].append(self._argmax(k))
        # Decode: one token of every unfinished sequence per step.
        while True:
            live = [s for s in range(len(prompts)) if len(outs[s]) < output_lens[s]]
            if not live:
                return outs
            self._decode([(outs[s][-1], len(prompts[s]) + len(outs[s]) - 1, s, True) for s in live])
            for k, s in enumerate(live):
                outs[s].append(self._argmax(k))

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


class HFEngine:
    def __init__(self, model: str, num_threads: int, batch_size: int, sampling: dict[str, Any]) -> None:
        from pagedllm.benchmarks.throughput import HFRunner

        self.runner = HFRunner(SimpleNamespace(model=model, hf_batch_size=batch_size, **sampling))

    def generate(self, prompts: list[list[int]], output_lens: list[int], sampling: dict[str, Any]) -> list[list[int]]:
        return self.runner.generate(prompts, output_lens)

    def close(self) -> None:
        self.runner.close()


def _timed(fn: Any, *args: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.engine != "llamacpp":  # llama.cpp's virtualenv has no torch; it takes its thread count itself
        import torch

        torch.set_num_threads(args.num_threads)
    with open(args.workload) as f:
        w = json.load(f)
    prompts, output_lens = w["prompts"], w["output_lens"]
    sampling = {"temperature": args.temperature, "top_p": args.top_p}
    if args.engine == "pagedllm":
        load_s, engine = _timed(PagedLLMEngine, args.model, args.num_threads, args.dtype, args.kv_cache_dtype)
    elif args.engine == "vllm":
        load_s, engine = _timed(VLLMEngine, args.model, args.num_threads, args.dtype)
    elif args.engine == "llamacpp":
        load_s, engine = _timed(LlamaCppEngine, args.model, args.num_threads)
    else:
        load_s, engine = _timed(HFEngine, args.model, args.num_threads, args.hf_batch_size, sampling)
    engine.generate(WARMUP["prompts"], WARMUP["output_lens"], sampling)
    result: dict[str, Any] = {"engine": args.engine, "load_s": load_s, "threads": args.num_threads}
    prompt_tokens, output_tokens = sum(map(len, prompts)), sum(output_lens)
    if args.mode == "throughput":
        walls, outs = [], []
        for _ in range(args.num_iters):
            wall, outs = _timed(engine.generate, prompts, output_lens, sampling)
            walls.append(wall)
        wall = statistics.median(walls)
        result.update(
            wall_s=wall,
            wall_s_all=walls,
            requests=len(prompts),
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            req_per_s=len(prompts) / wall,
            output_tok_per_s=output_tokens / wall,
            total_tok_per_s=(prompt_tokens + output_tokens) / wall,
        )
    else:
        ttfts, totals, outs = [], [], []
        for _ in range(args.num_iters):
            ttfts.append(_timed(engine.generate, prompts, [1], sampling)[0])
            total, outs = _timed(engine.generate, prompts, output_lens, sampling)
            totals.append(total)
        ttft, total = statistics.median(ttfts), statistics.median(totals)
        out_len = output_lens[0]
        result.update(
            ttft_s=ttft,
            total_s=total,
            ttft_s_all=ttfts,
            total_s_all=totals,
            prompt_tokens=prompt_tokens,
            output_tokens=out_len,
            decode_tok_per_s=(out_len - 1) / max(total - ttft, 1e-9),
            e2e_tok_per_s=out_len / total,
        )
    result["wrong_lengths"] = sum(len(o) != n for o, n in zip(outs, output_lens))
    result["token_ids"] = outs
    engine.close()
    del engine
    gc.collect()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["pagedllm", "hf", "vllm", "llamacpp"], required=True)
    parser.add_argument("--dtype", default="float32", help="--dtype of pagedllm or vLLM (float32 or bfloat16)")
    parser.add_argument(
        "--kv-cache-dtype", default="auto", help="pagedllm's --kv-cache-dtype (auto, bfloat16, float32)"
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", required=True, help="JSON with prompts (token id lists) and output_lens")
    parser.add_argument("--mode", choices=["throughput", "decode"], default="throughput")
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-iters", type=int, default=1)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (llama.cpp runs greedy only)")
    parser.add_argument("--top-p", type=float, default=1.0)
    args = parser.parse_args(argv)
    result = run(args)
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing spawn: this guard is required
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
