"""The `pagedllm` command: `serve`, `generate`, `chat`, `complete`, `run-batch`, `bench`.

The engine flags of every command are `EngineArgs.add_cli_args` (engine/arg_utils.py), named as `vllm serve`
names them, and become `EngineArgs` through `EngineArgs.from_cli_args`; no flag of the engine is defined here.
With no model the default model is used. A bad value exits with status 2 and names it. `chat --url URL` and
`complete` are clients of a running server, as `vllm chat` and `vllm complete` are (entrypoints/cli_client.py).
`serve --models-dir DIR` (or `--models A B ...`) runs the model router instead of one model (entrypoints/router/).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Iterable

import pagedllm
from pagedllm.engine.arg_utils import EngineArgs


def _engine_kwargs(ns: argparse.Namespace) -> dict[str, object]:
    """`LLM`'s keyword arguments from the parsed engine flags."""
    return dataclasses.asdict(EngineArgs.from_cli_args(ns))


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--sampling-seed", type=int, default=None)


def _sampling_params(ns: argparse.Namespace):
    from pagedllm import SamplingParams

    return SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        seed=ns.sampling_seed,
    )


def cmd_generate(ns: argparse.Namespace) -> int:
    from pagedllm import LLM

    llm = LLM(**_engine_kwargs(ns))
    params = _sampling_params(ns)
    if ns.chat:
        outs = llm.chat([{"role": "user", "content": ns.prompt}], params, use_tqdm=False)
    else:
        outs = llm.generate(ns.prompt, params, use_tqdm=False)
    print(outs[0].outputs[0].text)
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    if ns.url is not None:  # a client of a running server
        from pagedllm.entrypoints.cli_client import run_chat

        return run_chat(ns)
    from pagedllm import LLM

    llm = LLM(**_engine_kwargs(ns))
    params = _sampling_params(ns)
    history: list[dict[str, str]] = []
    if ns.system:
        history.append({"role": "system", "content": ns.system})
    if ns.quick is None:
        print("Type a message (Ctrl-D to quit).", file=sys.stderr)
    for line in [ns.quick] if ns.quick is not None else sys.stdin:
        line = line.strip()
        if not line:
            continue
        history.append({"role": "user", "content": line})
        reply = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
        history.append({"role": "assistant", "content": reply})
        print(reply, flush=True)
    return 0


def cmd_complete(ns: argparse.Namespace) -> int:
    from pagedllm.entrypoints.cli_client import run_complete

    return run_complete(ns)


def cmd_serve(ns: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.cli_args import router_mode

    if router_mode(ns):  # the router: no engine starts before a request names its model (MODEL: an error there)
        from pagedllm.entrypoints.openai.api_server import run_server
        from pagedllm.entrypoints.router.server import build_router_app

        return run_server(ns, router_app=build_router_app)

    import zmq.asyncio

    from pagedllm.engine.core_process import CoreProcess

    # The engine core starts loading the model now, before this process imports torch, transformers and the
    # server (seconds of imports): the two load in parallel. Nothing imported so far pulls in torch.
    engine_args = EngineArgs.from_cli_args(ns).for_engine_core()
    core = CoreProcess(engine_args, zmq.asyncio.Context())
    try:
        from pagedllm.entrypoints.openai.api_server import run_server
    except BaseException:
        core.close()
        raise
    return run_server(ns, engine_args, core=core)


def cmd_run_batch(ns: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.run_batch import main as run_batch

    return run_batch(ns)


def cmd_bench(ns: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(f"pagedllm.benchmarks.{ns.bench_kind}")
    return module.main(ns.bench_args, prog=f"pagedllm bench {ns.bench_kind}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="pagedllm: LLM inference engine")
    parser.add_argument("--version", action="version", version=f"%(prog)s {pagedllm.__version__}")
    parser.add_argument("--log-level", default="WARNING", help="level for libraries' log lines")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    EngineArgs.add_cli_args(gen)
    _sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    from pagedllm.entrypoints.cli_client import DEFAULT_URL, add_query_args

    chat = sub.add_parser(
        "chat", help="chat on stdin/stdout with the model's chat template (--url: with a running server's model)"
    )
    chat.add_argument("--system", "--system-prompt", default=None, help="a system message to start with")
    # no -q here: it is --quantization's short form among the engine flags (as in `vllm serve`)
    chat.add_argument("--quick", default=None, metavar="MESSAGE", help="send MESSAGE, print the reply, exit")
    add_query_args(chat, default_url=None)
    EngineArgs.add_cli_args(chat)
    _sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    complete = sub.add_parser("complete", help="complete prompts on stdin with a running server's model")
    complete.add_argument("-q", "--quick", default=None, metavar="PROMPT", help="complete PROMPT, print it, exit")
    add_query_args(complete, default_url=DEFAULT_URL)
    _sampling_args(complete)
    complete.set_defaults(func=cmd_complete)

    from pagedllm.entrypoints.openai.cli_args import add_server_args

    serve = sub.add_parser(
        "serve", help="start the OpenAI-compatible HTTP server", usage="pagedllm serve [MODEL] [options]"
    )
    EngineArgs.add_cli_args(serve, positional_model=True)
    add_server_args(serve)
    serve.set_defaults(func=cmd_serve)

    from pagedllm.entrypoints.openai.run_batch import add_batch_args

    batch = sub.add_parser(
        "run-batch",
        help="run a file of requests in OpenAI's batch format and write the answers (as vllm run-batch)",
        usage="pagedllm run-batch -i INPUT -o OUTPUT [MODEL] [options]",
    )
    add_batch_args(batch)
    EngineArgs.add_cli_args(batch, positional_model=True)
    add_server_args(batch)
    batch.set_defaults(func=cmd_run_batch)

    bench = sub.add_parser(
        "bench",
        help="benchmarks: `pagedllm bench {throughput,serve,latency,startup,allreduce,structured,embed} --help`",
        usage="pagedllm bench {throughput,serve,latency,startup,allreduce,structured,embed} [options]",
    )
    bench.add_argument(
        "bench_kind",
        choices=["throughput", "serve", "latency", "startup", "allreduce", "structured", "embed"],
        help="throughput: offline vs HF transformers; serve: against a running OpenAI-compatible server; "
        "latency: one batch through LLM; startup: `pagedllm serve` launch -> first 200 on /health; "
        "allreduce: the shared-memory all-reduce vs gloo between ranks on this machine; structured: the same "
        "requests with and without a JSON schema; embed: a pooling model's embeddings of a corpus (offline, a server, "
        "or sentence-transformers)",
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)
    return parser


def _config_path(argv: list[str], commands: Iterable[str]) -> tuple[str | None, str | None]:
    """(the subcommand, the --config file) of a command line; Nones where absent. As argparse, a prefix of
    --config (at least --conf) names it too."""
    command = next((a for a in argv if a in commands), None)
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if len(name) >= len("--conf") and "--config".startswith(name):
            if eq:
                return command, value
            if i + 1 < len(argv):
                return command, argv[i + 1]
    return command, None


def apply_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """`--config FILE` (vLLM's): the YAML file's `flag-name: value` entries become the subcommand's defaults, so
    that flags on the command line win. A value is what the flag would take: true for a switch (false: its --no-
    form, or nothing), a list for a flag of several values (as JSON text for a flag of one), a mapping as JSON text.
    ValueError naming an unknown key."""
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command, path = _config_path(argv, subparsers.choices)
    if path is None:
        return
    sub = subparsers.choices.get(command or "")
    if sub is None or "--config" not in sub._option_string_actions:
        raise ValueError(f"--config is a flag of `pagedllm serve` and `pagedllm run-batch`, not of {command!r}")
    import json

    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: cannot be read as YAML: {e}") from None
    if data is None:
        return
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values, got {type(data).__name__}")
    config_argv: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if flag not in sub._option_string_actions or flag == "--config":
            raise ValueError(f"--config {path}: {key!r} is not a flag of `pagedllm {command}`")
        if isinstance(value, bool):
            negative = "--no-" + flag[2:]
            config_argv += [flag] if value else [negative] if negative in sub._option_string_actions else []
        elif isinstance(value, list) and sub._option_string_actions[flag].nargs in ("+", "*"):
            config_argv += [flag, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)]
        elif isinstance(value, list):  # a flag of one value that is a list: JSON text (--allowed-origins)
            config_argv += [flag, json.dumps(value)]
        elif isinstance(value, dict):
            config_argv += [flag, json.dumps(value)]
        elif value is not None:
            config_argv += [flag, str(value)]
    required = [a for a in sub._actions if a.required]  # e.g. run-batch's -i/-o: the file may give them or not
    for action in required:
        action.required = False
    try:
        given = sub.parse_args(config_argv)
    except BaseException:
        for action in required:
            action.required = True
        raise
    for action in required:  # still required on the command line unless the file gave them
        action.required = getattr(given, action.dest, None) is None
    sub.set_defaults(**{k: v for k, v in vars(given).items() if v != sub.get_default(k)})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        apply_config_file(parser, argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return ns.func(ns)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
