"""The HTTP-server flags of `pagedllm serve` (the engine flags are `EngineArgs.add_cli_args`, engine/arg_utils.py).

Contract: importing this module is cheap (argparse only), so `pagedllm --help` does not load FastAPI.
Flag names follow `vllm serve` where vLLM has the same flag.
"""

from __future__ import annotations

import argparse
import json

DEFAULT_MAX_REQUEST_BYTES = "16MiB"
UVICORN_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


def json_list(value: str) -> list[str]:
    """A flag's JSON list of strings (argparse turns the ValueError into a usage error naming the flag)."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
        raise ValueError(f"expected a JSON list of strings, got {value!r}")
    return parsed


def router_mode(args: argparse.Namespace) -> bool:
    """True when `pagedllm serve` runs the model router (--models or --models-dir)."""
    return bool(getattr(args, "models", None) or getattr(args, "models_dir", None))


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument(
        "--config",
        default=None,
        metavar="YAML",
        help="read flags from a YAML file of `flag-name: value` (vLLM's): true turns a switch on, a list gives "
        "several values; flags on the command line win",
    )
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    g.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every route but /health and /ping "
        "(default: $PAGEDLLM_API_KEY, else no key)",
    )
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="answer 429 to a generation request (completions, chat, messages, responses) when this many are "
        "already in flight (default: no limit)",
    )
    g.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS)
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="no log line per HTTP request")
    g.add_argument(
        "--timeout-graceful-shutdown",
        "--shutdown-timeout",
        type=float,
        default=5.0,
        help="seconds open requests get to finish at shutdown before they are cancelled (default 5; "
        "--shutdown-timeout is vLLM's name)",
    )
    g.add_argument(
        "--uds",
        default=None,
        metavar="PATH",
        help="listen on this Unix domain socket instead of --host and --port (vLLM's)",
    )
    g.add_argument(
        "--root-path",
        default=None,
        help="the path prefix a reverse proxy serves the API under (FastAPI's root_path; e.g. /llm)",
    )
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: the private key file (PEM)")
    g.add_argument("--ssl-certfile", default=None, help="serve HTTPS: the certificate file (PEM)")
    g.add_argument("--ssl-ca-certs", default=None, help="with HTTPS: the CA certificates file to verify clients")
    g.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        help="with HTTPS: whether a client certificate is required (Python's ssl.CERT_*: 0 none, 1 optional, 2 "
        "required; default 0)",
    )
    g.add_argument(
        "--allowed-origins",
        type=json_list,
        default=[],
        metavar="JSON",
        help="origins browsers may call the API from, a JSON list (e.g. '[\"http://localhost:3000\"]' or '[\"*\"]'); "
        "default: none (no cross-origin access, as vLLM)",
    )
    g.add_argument(
        "--allowed-methods", type=json_list, default=["*"], metavar="JSON", help="with --allowed-origins: methods"
    )
    g.add_argument(
        "--allowed-headers", type=json_list, default=["*"], metavar="JSON", help="with --allowed-origins: headers"
    )
    g.add_argument(
        "--allow-credentials", action="store_true", help="with --allowed-origins: let browsers send credentials"
    )
    g.add_argument(
        "--disable-fastapi-docs",
        action="store_true",
        help="no OpenAPI description (/openapi.json) and no /docs or /redoc pages",
    )
    g.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="every response carries an X-Request-Id header: the request's own, else a new id",
    )
    g.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="every stream ends with a usage chunk, as if it asked for stream_options.include_usage",
    )
    g.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage gives prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache held",
    )
    g.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help='logprobs name each token "token_id:N" (for tokens whose text JSON cannot carry whole); a request\'s '
        "return_tokens_as_token_ids overrides it",
    )
    g.add_argument("--log-error-stack", action="store_true", help="log the traceback behind each error response")
    g.add_argument(
        "--chat-template-content-format",
        default="auto",
        choices=("auto", "string", "openai"),
        help="how a message's content reaches the chat template: string (its text parts joined), openai (a list of "
        '{"type": "text", "text"} parts, for templates that loop over them) or auto (string) (default: auto)',
    )
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests carry their own `chat_template` (Jinja run on the server; off by default)",
    )
    g.add_argument(
        "--default-chat-template-kwargs",
        default=None,
        metavar="JSON",
        help="the chat template's variables for every request, as a JSON object (e.g. '{\"enable_thinking\": "
        "false}' for Qwen3); a request's chat_template_kwargs override them",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide to call tools (tool_choice "auto"); needs --tool-call-parser',
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        help="how tool calls are written in the model's output: hermes (<tool_call>{json}</tool_call>: the Hermes "
        'and Qwen families), llama3_json or llama4_json (<|python_tag|>{"name": ..., "parameters": ...}; ...: '
        "Llama 3.1/3.2/4), mistral ([TOOL_CALLS]...), pythonic or llama4_pythonic ([f(x=1), g()]: Llama 3.2/4), "
        "qwen3_coder (<tool_call><function=f><parameter=x>...: Qwen3-Coder), openai (harmony calls: gpt-oss)",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters served at start (needs --enable-lora), each `name=path` or JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; a request names one by `model`',
    )
    g.add_argument(
        "--max-request-bytes",
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="refuse a request body larger than this with a 413, before it is read (e.g. 16MiB, 1GB or a byte "
        "count; default 16MiB: a million-token prompt as text is about 4 MB)",
    )
    g.add_argument(
        "--response-role",
        default="assistant",
        help="role of the chat reply when the request asks for a generation prompt (add_generation_prompt, the "
        "default); else the reply continues the last message and takes its role (default: assistant)",
    )
    g.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log each request when it is received: its id, prompt (see --max-log-len) and sampling params (off by "
        "default, as in vLLM)",
    )
    g.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="no log line per request (the default; vLLM's older flag, kept so that its launch lines run unchanged; "
        "wins over --enable-log-requests)",
    )
    g.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help="with --enable-log-requests: the most prompt characters and prompt token ids logged (default: all)",
    )
    g.add_argument(
        "--sleep-auto-wake",
        action="store_true",
        help="a request that arrives while the model sleeps (POST /sleep) wakes it, instead of a 503",
    )
    g.add_argument(
        "--enable-debug-routes",
        action="store_true",
        help="expose GET /debug/kv_cache (KV block-pool counts and the engine-core pid), for tests",
    )
    add_router_args(parser)


def add_router_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("router (many models behind one server; instead of MODEL)")
    g.add_argument(
        "--models-dir",
        default=None,
        metavar="DIR",
        help="serve every .gguf file and every folder with config.json in DIR, each named by its file (without "
        ".gguf) or folder, each in its own engine-core process started on its first request; the engine flags apply "
        "to every model (--max-model-len as a ceiling), the runner is each model's own (--runner auto)",
    )
    g.add_argument(
        "--models",
        nargs="+",
        default=None,
        metavar="PATH",
        help="serve these .gguf files and HF folders as the router does (named likewise; with --models-dir: both)",
    )
    g.add_argument(
        "--models-max",
        type=int,
        default=None,
        metavar="N",
        help="at most N models awake at once: loading another puts the least recently used idle one to sleep (see "
        "--models-evict); a model with requests in flight is never evicted (default: no limit)",
    )
    g.add_argument(
        "--models-evict",
        default="sleep",
        choices=("sleep", "unload"),
        help="how --models-max makes room: sleep (the process stays, its weights and KV cache are freed; waking is "
        "fast) or unload (the process stops) (default: sleep)",
    )
    g.add_argument(
        "--sleep-idle-seconds",
        type=float,
        default=None,
        metavar="S",
        help="put a model that served no request for S seconds to sleep (default: never)",
    )
    g.add_argument(
        "--models-max-running",
        type=int,
        default=1,
        metavar="N",
        help="at most N models compute at once (default 1: on a few cores, two models side by side are much slower "
        "than one after the other); the others' requests wait for a turn",
    )
    g.add_argument(
        "--models-wait-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="the longest a request waits for its model to load, or for room to load it, before a 503 (default "
        "600); a client that leaves ends its wait",
    )
