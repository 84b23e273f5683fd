"""Structured-output cost: `pagedllm bench structured`: the same requests with and without a JSON schema, in one run.

Contract. `--num-prompts` chat prompts (each asks for a record about one of a fixed list of subjects) go through
`LLM` at once, batched `--max-num-seqs` (default 16) at a time, sampled at `--temperature` (default 0.8) with
fixed seeds. First constrained: each request follows `--json-schema` (a file, or the built-in schema: a record of
people with bounded strings, integer ranges, enums and arrays), and every output is checked against it (a
request that ends by length is counted, not failed). Then unconstrained: the same prompts and seeds, each with
`max_tokens` equal to the number of tokens its constrained twin produced and `ignore_eos`, so both runs
generate exactly the same number of tokens for each request. Reported: output tokens/s of each (median of
`--num-iters`), their ratio, and the engine core's bitmask time per constrained step and per row (the
StructuredOutputManager's counters). Engine flags are `pagedllm serve`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time
from typing import Any

DEFAULT_PROG = "pagedllm bench structured"

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "subject": {"type": "string", "maxLength": 24},
        "category": {"type": "string", "enum": ["person", "place", "thing", "idea"]},
        "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
        "facts": {
            "type": "array",
            "minItems": 3,
            "maxItems": 5,
            "items": {
                "type": "object",
                "properties": {
                    "text": {"type": "string", "maxLength": 40},
                    "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
                },
                "required": ["text", "confidence"],
                "additionalProperties": False,
            },
        },
        "related": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 16}},
    },
    "required": ["subject", "category", "year", "facts", "related"],
    "additionalProperties": False,
}
SUBJECTS = [
    "the Eiffel Tower", "Marie Curie", "the printing press", "Mount Everest", "democracy", "the Moon",
    "Ada Lovelace", "the Nile", "jazz", "the telephone", "Rome", "photosynthesis", "chess", "Tokyo",
    "the bicycle", "Beethoven",
]  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from pagedllm.engine.arg_utils import EngineArgs

    EngineArgs.add_cli_args(parser)
    parser.set_defaults(max_num_seqs=16)
    add = parser.add_argument
    add("--num-prompts", type=int, default=64, help="requests (default 64)")
    add("--json-schema", default=None, metavar="PATH", help="a JSON schema file (default: the built-in record)")
    add("--temperature", type=float, default=0.8, help="sampling temperature (default 0.8)")
    add("--max-tokens", type=int, default=256, help="cap of each constrained request (default 256)")
    add("--num-iters", type=int, default=3, help="timed runs of each kind, alternating; medians (default 3)")
    add("--json-out", default=None, metavar="PATH", help="append a JSON record to PATH (JSON lines)")
    return parser


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().split("\n\n")[0].splitlines()
        info = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in lines if ":" in line)}
    except OSError:
        return platform.processor() or "unknown CPU"
    flags = info.get("flags", "").split()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return (
        f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model {info.get('model', '?')}, "
        f"{isa}), {os.cpu_count()} CPUs"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    import jsonschema

    from pagedllm import LLM, SamplingParams
    from pagedllm.engine.arg_utils import EngineArgs

    schema = SCHEMA
    if args.json_schema:
        with open(args.json_schema, encoding="utf-8") as f:
            schema = json.load(f)
    llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args)))
    try:
        ip = llm.input_processor
        prompts = []
        for i in range(args.num_prompts):
            text = f"Write a JSON record about {SUBJECTS[i % len(SUBJECTS)]} for this schema: {json.dumps(schema)}"
            templated = ip.apply_chat_template([{"role": "user", "content": text}])
            prompts.append({"prompt_token_ids": ip.tokenize(templated, add_special_tokens=False)})

        def constrained_params() -> list[Any]:
            return [
                SamplingParams(
                    temperature=args.temperature,
                    seed=i,
                    max_tokens=args.max_tokens,
                    structured_outputs={"json": schema},
                )
                for i in range(args.num_prompts)
            ]

        # Warm-up (compiles and caches the grammar, loads the tokenizer into the engine core), untimed.
        llm.generate(prompts[:2], constrained_params()[:2], use_tqdm=False)
        lengths: list[int] | None = None
        timings: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
        valid = length_capped = 0
        mask_before = llm.engine_core.call_utility("get_structured_output_stats")
        mask_after = mask_before
        for it in range(args.num_iters):
            # Constrained first in the first round (its lengths set the unconstrained twins'), then alternating.
            for kind in ("constrained", "unconstrained") if it % 2 == 0 else ("unconstrained", "constrained"):
                llm.reset_prefix_cache()
                if kind == "constrained":
                    params = constrained_params()
                else:
                    assert lengths is not None
                    params = [
                        SamplingParams(temperature=args.temperature, seed=i, max_tokens=n, ignore_eos=True)
                        for i, n in enumerate(lengths)
                    ]
                before = llm.engine_core.call_utility("get_structured_output_stats")
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                wall = time.perf_counter() - start
                timings[kind].append(wall)
                if kind == "constrained":
                    mask_after = llm.engine_core.call_utility("get_structured_output_stats")
                    mask_before = before
                    produced = [len(o.outputs[0].token_ids) for o in outs]
                    if lengths is None:
                        lengths = produced
                        for o in outs:
                            if o.outputs[0].finish_reason == "length":
                                length_capped += 1
                                continue
                            jsonschema.validate(json.loads(o.outputs[0].text), schema)
                            valid += 1
                    elif produced != lengths:
                        print(f"  note: run {it + 1} produced {sum(produced)} tokens, the first {sum(lengths)}")
                print(f"  {kind}: run {it + 1}: {wall:.2f} s", flush=True)
    finally:
        llm.shutdown()
    assert lengths is not None
    tokens = sum(lengths)
    result: dict[str, Any] = {"output_tokens": tokens, "valid": valid, "length_capped": length_capped}
    for kind, walls in timings.items():
        result[f"{kind}_s"] = walls
        result[f"{kind}_tok_per_s"] = tokens / statistics.median(walls)
    result["ratio"] = result["constrained_tok_per_s"] / result["unconstrained_tok_per_s"]
    steps = mask_after["mask_steps"] - mask_before["mask_steps"]
    rows = mask_after["mask_rows"] - mask_before["mask_rows"]
    secs = mask_after["mask_seconds"] - mask_before["mask_seconds"]
    result["mask_ms_per_step"] = 1000 * secs / max(steps, 1)
    result["mask_us_per_row"] = 1e6 * secs / max(rows, 1)
    result["mask_share"] = secs / statistics.median(timings["constrained"])
    result["forced_drafts"] = mask_after.get("forced_drafts", 0) - mask_before.get("forced_drafts", 0)
    result["forced_accepted"] = mask_after.get("forced_accepted", 0) - mask_before.get("forced_accepted", 0)
    return result


def main(argv: list[str] | None = None, prog: str = DEFAULT_PROG) -> int:
    import sys

    parser = add_arguments(argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0]))
    args = parser.parse_args(argv)
    print(f"CPU: {_cpu()}; batch (max_num_seqs) {args.max_num_seqs}, {args.num_prompts} requests", flush=True)
    r = run(args)
    print(
        f"\noutput tokens per run: {r['output_tokens']} (constrained outputs valid: {r['valid']}, "
        f"ended by length: {r['length_capped']})"
    )
    print(f"constrained   : {r['constrained_tok_per_s']:.1f} output tok/s (runs {r['constrained_s']})")
    print(f"unconstrained : {r['unconstrained_tok_per_s']:.1f} output tok/s (runs {r['unconstrained_s']})")
    print(f"constrained / unconstrained: {r['ratio']:.3f}")
    print(
        f"bitmask: {r['mask_ms_per_step']:.3f} ms per constrained step, {r['mask_us_per_row']:.1f} us per row, "
        f"{100 * r['mask_share']:.1f}% of the constrained wall time (computed beside the forward pass: the two share "
        "the cores)"
    )
    print(
        f"forced tokens verified as drafts (last constrained run): {r['forced_drafts']}, "
        f"{r['forced_accepted']} accepted"
    )
    print(f"command: {prog} {' '.join(argv if argv is not None else sys.argv[1:])}")
    if args.json_out:
        with open(args.json_out, "a", encoding="utf-8") as f:
            f.write(json.dumps({"bench": "structured", "argv": argv, **r}) + "\n")
    return 0
