"""Offline throughput benchmark: pagedllm `LLM.generate` against HF transformers `generate`, in one run.

Both engines use the same weights (default: SmolLM2-135M-Instruct from its GGUF), fp32, the same number of
torch threads, greedy decoding unless ``--temperature`` says otherwise. Two modes:

* ``throughput``: N requests of random token-id prompts whose input and output lengths are drawn uniformly
  from inclusive ranges with a fixed seed, ``ignore_eos`` so every request produces exactly its requested
  output. pagedllm receives all of them at once; HF runs them the way a user of ``generate`` would: static
  batches of ``--hf-batch-size`` in arrival order, left-padded, each batch generating its longest requested
  output (``min_new_tokens = max_new_tokens`` so eos cannot end it early). Only requested tokens count for
  either engine: output tok/s = sum of requested output lengths / wall time.
  ``--dataset sharegpt|prefix-repetition|repeat`` replaces the random token ids by the text prompts of the shared
  datasets (pagedllm/benchmarks/datasets.py), tokenized with the model's tokenizer, with their output lengths.
  Timed runs show a progress bar on stderr (``--disable-tqdm`` turns it off).
* ``decode``: one request (default 128 prompt tokens, 128 output tokens). Each engine is timed generating 1
  token (prefill, "ttft") and the full output; decode tok/s = (output_len - 1) / (t_full - t_1).

Each engine gets one small untimed warm-up call. pagedllm's prefix cache is reset before every timed call so
no run reuses another's prompt KV. The table is printed with the command line that produced it; ``--json-out``
appends one JSON record per run (JSON lines).

pagedllm's engine flags are `pagedllm serve`'s (`EngineArgs.add_cli_args`: ``--model``, ``--max-num-seqs``,
``--num-threads``, ...); ``--seed`` also seeds the workload, ``--num-threads`` applies to both engines, and
``--dtype`` must stay float32.

Usage: ``python -m bench.throughput [--mode throughput|decode] ...`` (``--help``, bench/README.md).
``main(argv)`` and ``add_arguments(parser)`` + ``run(args)`` let ``pagedllm bench throughput`` reuse it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import gc
import io
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedllm.benchmarks.datasets import add_dataset_args
from pagedllm.config import resolve_dtype

# Ids below this are special/control tokens in SmolLM2 (ids < ~20); stay well clear of them.
MIN_PROMPT_TOKEN_ID = 100
DEFAULT_PROG = "pagedllm bench throughput"
OURS, HF = "pagedllm", "hf-transformers"


# ---- workload ----------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]  # [num_requests][input_len_i] random token ids
    output_lens: list[int]  # [num_requests] requested output tokens

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def parse_range(text: str) -> tuple[int, int]:
    """Parse "32-384" (inclusive) or "128" into (lo, hi)."""
    try:
        lo, _, hi = str(text).partition("-")
        bounds = (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a length or a range like 32-384, got {text!r}") from None
    if bounds[0] < 1 or bounds[1] < bounds[0]:
        raise argparse.ArgumentTypeError(f"range must satisfy 1 <= lo <= hi, got {text!r}")
    return bounds


def make_workload(
    num: int, input_range: tuple[int, int], output_range: tuple[int, int], vocab_size: int, seed: int
) -> Workload:
    """Uniform lengths in the inclusive ranges, uniform token ids in [MIN_PROMPT_TOKEN_ID, vocab_size)."""
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(input_range[0], input_range[1] + 1, size=num)
    out_lens = rng.integers(output_range[0], output_range[1] + 1, size=num)
    prompts = [rng.integers(MIN_PROMPT_TOKEN_ID, vocab_size, size=int(n)).tolist() for n in in_lens]
    return Workload(prompts, [int(o) for o in out_lens])


# ---- engines -----------------------------------------------------------------------------------------------


class OursRunner:
    """pagedllm's offline `LLM`: every request submitted at once, the scheduler batches them."""

    name = OURS

    def __init__(self, args: argparse.Namespace) -> None:
        from pagedllm import LLM
        from pagedllm.engine.arg_utils import EngineArgs

        self.llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args)))
        self.temperature = args.temperature
        self.top_p = getattr(args, "top_p", 1.0)
        self.vocab_size = int(self.llm.config.model_config.vocab_size)
        self.stats: dict[str, Any] = {}

    def generate(self, prompts: list[list[int]], output_lens: list[int], progress: bool = False) -> list[list[int]]:
        from pagedllm import SamplingParams

        self.llm.reset_prefix_cache()
        params = [
            SamplingParams(temperature=self.temperature, top_p=self.top_p, max_tokens=n, ignore_eos=True)
            for n in output_lens
        ]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=progress)
        return [list(o.outputs[0].token_ids) for o in outs]

    def close(self) -> None:
        self.llm.shutdown()
        del self.llm  # the caller may still hold this runner; the model and KV cache must go now


class HFRunner:
    """HF transformers `generate` as a user would run it: static, left-padded batches in arrival order."""

    name = HF

    def __init__(self, args: argparse.Namespace) -> None:
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.logging.set_verbosity_error()
        path, kwargs = args.model, {"dtype": torch.float32}
        if os.path.isfile(path) and path.endswith(".gguf"):
            path, kwargs["gguf_file"] = os.path.dirname(path), os.path.basename(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
        cfg, gen = self.model.config, self.model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else cfg.eos_token_id
        eos = eos[0] if isinstance(eos, list) else eos
        pad = gen.pad_token_id if gen.pad_token_id is not None else getattr(cfg, "pad_token_id", None)
        self.pad_token_id = int(pad if pad is not None else (eos if eos is not None else 0))
        self.temperature = args.temperature
        self.top_p = getattr(args, "top_p", 1.0)
        self.batch_size = args.hf_batch_size
        self.vocab_size = int(cfg.vocab_size)
        self.stats: dict[str, Any] = {}

    def _generate_batch(self, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: what a tokenizer with padding_side="left" produces
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        sampling: dict[str, Any] = {"do_sample": False}
        if self.temperature > 0:  # temperature (and top-p) sampling like ours: switch off HF's default top-k=50
            sampling = {"do_sample": True, "temperature": self.temperature, "top_k": 0, "top_p": self.top_p}
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            pad_token_id=self.pad_token_id,
            use_cache=True,
            **sampling,
        )
        assert out.shape[1] == width + max_new, f"HF generated {out.shape[1] - width} tokens, asked {max_new}"
        self.stats["padded_prompt_tokens"] += ids.numel()
        self.stats["generated_tokens"] += len(prompts) * max_new
        return out[:, width:].tolist()

    def generate(self, prompts: list[list[int]], output_lens: list[int], progress: bool = False) -> list[list[int]]:
        from tqdm import tqdm

        self.stats = {"batch_size": self.batch_size, "padded_prompt_tokens": 0, "generated_tokens": 0}
        results: list[list[int]] = []
        starts = range(0, len(prompts), self.batch_size)
        with torch.inference_mode():
            for start in tqdm(starts, desc="HF batches", file=sys.stderr, disable=not progress):
                lens = output_lens[start : start + self.batch_size]
                rows = self._generate_batch(prompts[start : start + self.batch_size], max(lens))
                # Only the requested tokens of each row count; the rest is the cost of static batching.
                results.extend(row[:n] for row, n in zip(rows, lens))
        return results

    def close(self) -> None:
        del self.model


Runner = OursRunner | HFRunner


def _timed(fn: Callable[..., Any], *fn_args: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn(*fn_args)
    return time.perf_counter() - start, out


def engines(args: argparse.Namespace) -> Iterator[tuple[Runner, float]]:
    """Load, warm up, yield and free each engine in turn (never two models in memory at once)."""
    for cls in [OursRunner] + ([] if args.no_hf else [HFRunner]):
        print(f"loading {cls.name} ...", flush=True)
        captured = io.StringIO()  # keeps HF's GGUF de-quantization progress bar out of the report
        try:
            with contextlib.redirect_stderr(captured):
                load_s, runner = _timed(cls, args)
        except BaseException:
            sys.stderr.write(captured.getvalue())
            raise
        print(f"  loaded in {load_s:.1f} s", flush=True)
        if args.warmup:
            warm = make_workload(2, (16, 16), (4, 4), runner.vocab_size, args.seed + 10_000)
            runner.generate(warm.prompts, warm.output_lens)
        try:
            yield runner, load_s
        finally:
            runner.close()
            del runner
            gc.collect()


def _check_lengths(name: str, outs: list[list[int]], wanted: list[int]) -> int:
    bad = sum(len(o) != n for o, n in zip(outs, wanted))
    if bad:
        print(f"WARNING: {name}: {bad} requests did not produce exactly their requested tokens", flush=True)
    return bad


# ---- modes -------------------------------------------------------------------------------------------------


def build_workload(args: argparse.Namespace, runner: Runner) -> tuple[Workload, dict[str, Any]]:
    """The requests of --dataset (random token ids by default) and their description for the record."""
    if args.dataset_name == "random":
        in_range = (args.input_len, args.input_len) if args.input_len else args.input_len_range
        out_range = (args.output_len, args.output_len) if args.output_len else args.output_len_range
        w = make_workload(args.num_prompts, in_range, out_range, runner.vocab_size, args.seed)
        print(
            f"workload: {args.num_prompts} requests, input {in_range[0]}-{in_range[1]}, output "
            f"{out_range[0]}-{out_range[1]}, seed {args.seed}: {w.prompt_tokens} prompt tokens, "
            f"{w.output_tokens} output tokens",
            flush=True,
        )
        workload = {"num_prompts": args.num_prompts, "input_range": in_range, "output_range": out_range}
        return w, {"dataset": "random", **workload, "seed": args.seed}
    from pagedllm.benchmarks.datasets import load_tokenizer, sample_requests

    max_len = runner.llm.config.model_config.max_model_len if isinstance(runner, OursRunner) else None
    reqs = sample_requests(args, load_tokenizer(args.model), args.num_prompts, args.seed, max_len)
    w = Workload([r.prompt_token_ids for r in reqs], [r.expected_output_len for r in reqs])
    print(
        f"workload: {args.num_prompts} requests from {args.dataset_name}, seed {args.seed}: {w.prompt_tokens} "
        f"prompt tokens, {w.output_tokens} output tokens",
        flush=True,
    )
    prefix = {"prefix-repetition": "prefix_repetition_", "repeat": "repeat_"}.get(
        args.dataset_name, ("sharegpt_", "dataset_path")
    )
    params = {k: v for k, v in vars(args).items() if k.startswith(prefix)}
    return w, {"dataset": args.dataset_name, "num_prompts": args.num_prompts, "seed": args.seed, **params}


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    outputs: dict[str, list[list[int]]] = {}
    w: Workload | None = None
    workload: dict[str, Any] = {}
    for runner, load_s in engines(args):
        if w is None:  # the vocabulary comes from the first engine; the workload is fixed from then on
            w, workload = build_workload(args, runner)
        times = []
        for it in range(args.num_iters):
            wall, outputs[runner.name] = _timed(runner.generate, w.prompts, w.output_lens, not args.disable_tqdm)
            times.append(wall)
            print(f"  {runner.name}: iteration {it + 1}/{args.num_iters}: {wall:.2f} s", flush=True)
        wall = statistics.median(times)
        rows.append(
            {
                "engine": runner.name,
                "requests": args.num_prompts,
                "prompt_tokens": w.prompt_tokens,
                "output_tokens": w.output_tokens,
                "wall_s": wall,
                "wall_s_all": times,
                "req_per_s": args.num_prompts / wall,
                "output_tok_per_s": w.output_tokens / wall,
                "total_tok_per_s": (w.prompt_tokens + w.output_tokens) / wall,
                "load_s": load_s,
                "length_mismatches": _check_lengths(runner.name, outputs[runner.name], w.output_lens),
                **runner.stats,
            }
        )
    return _report_throughput(args, w, rows, outputs, workload)


def _report_throughput(
    args: argparse.Namespace,
    w: Workload,
    rows: list[dict[str, Any]],
    outputs: dict[str, list[list[int]]],
    workload: dict[str, Any],
) -> dict[str, Any]:
    print_table(rows, THROUGHPUT_COLUMNS)
    record: dict[str, Any] = {"workload": workload, "results": rows}
    if len(rows) == 2:
        record["ratio_ours_over_hf"] = rows[0]["output_tok_per_s"] / rows[1]["output_tok_per_s"]
        print(f"\nratio pagedllm / HF (output tok/s): {record['ratio_ours_over_hf']:.2f}x")
        print(
            f"HF computed {rows[1]['padded_prompt_tokens']} padded prompt tokens and "
            f"{rows[1]['generated_tokens']} generated tokens for {w.prompt_tokens} prompt / "
            f"{w.output_tokens} requested"
        )
        if args.temperature == 0:
            pairs = list(zip(outputs[OURS], outputs[HF]))
            same, first = sum(a == b for a, b in pairs), sum(a[:1] == b[:1] for a, b in pairs)
            record["greedy_agreement"] = {"requests": len(pairs), "identical": same, "first_token": first}
            print(
                f"greedy agreement with HF: {same}/{len(pairs)} requests identical, first token "
                f"{first}/{len(pairs)} (fp32 batching noise can flip near-ties on random prompts)"
            )
    return record


def run_decode(args: argparse.Namespace) -> dict[str, Any]:
    in_len, out_len = args.input_len or 128, args.output_len or 128
    if out_len < 2:
        raise SystemExit("decode mode needs --output-len >= 2")
    rows: list[dict[str, Any]] = []
    w: Workload | None = None
    for runner, load_s in engines(args):
        if w is None:
            w = make_workload(1, (in_len, in_len), (out_len, out_len), runner.vocab_size, args.seed)
        ttfts, totals = [], []
        for it in range(args.num_iters):
            ttfts.append(_timed(runner.generate, w.prompts, [1])[0])
            total, outs = _timed(runner.generate, w.prompts, w.output_lens)
            totals.append(total)
            _check_lengths(runner.name, outs, w.output_lens)
            print(
                f"  {runner.name}: iteration {it + 1}/{args.num_iters}: 1 token {ttfts[-1]:.3f} s, "
                f"{out_len} tokens {total:.2f} s",
                flush=True,
            )
        ttft, total = statistics.median(ttfts), statistics.median(totals)
        rows.append(
            {
                "engine": runner.name,
                "prompt_tokens": in_len,
                "output_tokens": out_len,
                "ttft_s": ttft,
                "total_s": total,
                "ttft_s_all": ttfts,
                "total_s_all": totals,
                "load_s": load_s,
                "decode_tok_per_s": (out_len - 1) / max(total - ttft, 1e-9),
                "e2e_tok_per_s": out_len / total,
            }
        )
    print_table(rows, DECODE_COLUMNS)
    record: dict[str, Any] = {
        "workload": {"input_len": in_len, "output_len": out_len, "seed": args.seed},
        "results": rows,
    }
    if len(rows) == 2:
        record["ratio_ours_over_hf"] = rows[0]["decode_tok_per_s"] / rows[1]["decode_tok_per_s"]
        print(f"\nratio pagedllm / HF (decode tok/s): {record['ratio_ours_over_hf']:.2f}x")
    return record


# ---- report ------------------------------------------------------------------------------------------------

# (header, key, format) of each printed column.
THROUGHPUT_COLUMNS = [
    ("engine", "engine", "{}"),
    ("requests", "requests", "{}"),
    ("prompt tok", "prompt_tokens", "{}"),
    ("output tok", "output_tokens", "{}"),
    ("wall s", "wall_s", "{:.2f}"),
    ("req/s", "req_per_s", "{:.3f}"),
    ("output tok/s", "output_tok_per_s", "{:.1f}"),
    ("total tok/s", "total_tok_per_s", "{:.1f}"),
]
DECODE_COLUMNS = [
    ("engine", "engine", "{}"),
    ("prompt tok", "prompt_tokens", "{}"),
    ("output tok", "output_tokens", "{}"),
    ("ttft s", "ttft_s", "{:.3f}"),
    ("total s", "total_s", "{:.2f}"),
    ("decode tok/s", "decode_tok_per_s", "{:.1f}"),
    ("e2e tok/s", "e2e_tok_per_s", "{:.1f}"),
]


def print_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> None:
    cells = [[h for h, _, _ in columns]] + [[fmt.format(r[key]) for _, key, fmt in columns] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    cells.insert(1, ["-" * w for w in widths])
    print()
    for line in cells:
        print("  ".join(c.ljust(wd) if i == 0 else c.rjust(wd) for i, (c, wd) in enumerate(zip(line, widths))))


# ---- entry points ------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the benchmark's flags to `parser` (shared with `pagedllm bench throughput`)."""
    from pagedllm.engine.arg_utils import EngineArgs

    EngineArgs.add_cli_args(parser)
    add = parser.add_argument
    add("--mode", choices=["throughput", "decode"], default="throughput")
    add("--num-prompts", type=int, default=64, help="throughput mode: number of requests (default 64)")
    add(
        "--input-len-range",
        type=parse_range,
        default=(32, 384),
        metavar="LO-HI",
        help="inclusive uniform range of prompt lengths (default 32-384)",
    )
    add(
        "--output-len-range",
        type=parse_range,
        default=(32, 192),
        metavar="LO-HI",
        help="inclusive uniform range of output lengths (default 32-192)",
    )
    add("--input-len", type=int, default=None, help="fixed prompt length (overrides the range; decode: 128)")
    add("--output-len", type=int, default=None, help="fixed output length (overrides the range; decode: 128)")
    add(
        "--temperature",
        type=float,
        default=0.0,
        help="0 (default): greedy for both engines (HF do_sample=False); >0: plain temperature sampling",
    )
    add("--hf-batch-size", type=int, default=16, help="HF static batch size, arrival order (default 16)")
    add("--no-hf", action="store_true", help="skip the HF transformers peer")
    add("--num-iters", type=int, default=1, help="timed repetitions per engine; the median is reported")
    add(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one small untimed generate per engine before timing (default on)",
    )
    add("--json-out", default=None, metavar="PATH", help="append a JSON record to PATH (JSON lines)")
    add("--disable-tqdm", action="store_true", help="throughput mode: no progress bar during timed runs")
    add_dataset_args(parser, random_flags=False)
    return parser


def _validate(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "hf_batch_size", "num_threads", "num_iters", "input_len", "output_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.temperature < 0:
        raise SystemExit(f"--temperature must be >= 0, got {args.temperature}")
    if resolve_dtype(args.dtype) != torch.float32:
        raise SystemExit(f"--dtype must be float32 (HF runs in float32 beside it), got {args.dtype!r}")
    if args.mode == "decode" and args.dataset_name != "random":
        raise SystemExit(f"--dataset {args.dataset_name} applies to --mode throughput only (decode uses random ids)")
    if args.dataset_name == "sharegpt" and not (args.dataset_path and os.path.isfile(args.dataset_path)):
        raise SystemExit(f"--dataset sharegpt needs --dataset-path to a ShareGPT JSON file, got {args.dataset_path!r}")


def _git_commit() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _default_command() -> str:
    """This process's command line, in a form that can be pasted back into a shell."""
    argv = list(sys.argv)
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if argv and argv[0].endswith(".py"):  # `python -m bench.throughput` or `python bench/throughput.py`
        argv = ["python", "-m", spec.name, *argv[1:]] if spec is not None and spec.name else ["python", *argv]
    return shlex.join(argv)


def run(args: argparse.Namespace, command: str | None = None) -> int:
    """Run the benchmark described by parsed `args`; `command` is the command line to print and record."""
    from pagedllm.config import default_model_path, model_from_env, num_threads_default

    _validate(args)
    args.model = args.model or model_from_env() or default_model_path()
    if args.num_threads is None:  # both engines get the same number of threads
        args.num_threads = num_threads_default()
    command = command or _default_command()
    torch.set_num_threads(args.num_threads)
    load_avg = os.getloadavg()[0]
    print(f"command: {command}", flush=True)
    if load_avg > 0.5:
        print(
            f"WARNING: 1-minute load average is {load_avg:.2f} before starting: the machine is busy, and "
            "torch's OpenMP threads slow down badly when they share cores; numbers are indicative only",
            flush=True,
        )
    print(
        f"model: {args.model} (fp32, {args.num_threads} torch threads, temperature {args.temperature})",
        flush=True,
    )
    record = run_decode(args) if args.mode == "decode" else run_throughput(args)
    print(f"\ncommand: {command}")
    if args.json_out:
        record = {
            "timestamp": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "command": command,
            "mode": args.mode,
            "model": args.model,
            "git_commit": _git_commit(),
            "args": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(args).items() if not callable(v)},
            "machine": {
                "platform": platform.platform(),
                "cpu_count": os.cpu_count(),
                "torch": torch.__version__,
                "python": platform.python_version(),
                "loadavg_1m_start": load_avg,
                "loadavg_1m_end": os.getloadavg()[0],
            },
            **record,
        }
        with open(args.json_out, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        print(f"appended a record to {args.json_out}")
    return 0


def main(argv: list[str] | None = None, prog: str = DEFAULT_PROG) -> int:
    """Parse `argv` (default: sys.argv[1:]) and run; `prog` names the command in help and in the output."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    args = add_arguments(parser).parse_args(argv)
    try:
        return run(args, None if argv is None else shlex.join([*shlex.split(prog), *argv]))
    except ValueError as e:  # bad input found after parsing (a dataset file, a model path): name it, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
