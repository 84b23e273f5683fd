"""EngineArgs and its flags: every field has one (vLLM's name), flags parse back to the same arguments, the KV
cache is sized from --gpu-memory-utilization when asked, and the environment-only device settings."""

from __future__ import annotations

import argparse
import dataclasses
import logging

import pytest

from pagedllm.config import cpu_isa, cpu_kernels_enabled
from pagedllm.engine import arg_utils
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.cli import build_parser
from tests.model_utils import make_tiny_model

# vLLM's flag names (`vllm serve --help`) for the settings pagedllm has, plus --num-threads (ours).
VLLM_FLAGS = [
    "--model",
    "--tokenizer",
    "--served-model-name",
    "--dtype",
    "--seed",
    "--max-model-len",
    "--block-size",
    "--kv-cache-memory-bytes",
    "--gpu-memory-utilization",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--num-gpu-blocks-override",
    "--max-num-batched-tokens",
    "--max-num-seqs",
    "--scheduling-policy",
    "--long-prefill-token-threshold",
    "--tensor-parallel-size",
    "-tp",
    "--device",
    "--enforce-eager",
    "--attention-backend",
    "--num-threads",
]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> str:
    return make_tiny_model(tiny_model_dir, "LlamaForCausalLM")


def engine_parser(positional_model: bool = False) -> argparse.ArgumentParser:
    return EngineArgs.add_cli_args(argparse.ArgumentParser(), positional_model=positional_model)


def parse(*argv: str, positional_model: bool = False) -> EngineArgs:
    return EngineArgs.from_cli_args(engine_parser(positional_model).parse_args(list(argv)))


def option_strings(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    return {a.dest: list(a.option_strings) for a in parser._actions}


def test_every_field_has_a_flag_named_after_it():
    """Fails when a field is added to EngineArgs without its flag."""
    flags = option_strings(engine_parser())
    missing = [f.name for f in dataclasses.fields(EngineArgs) if f.name not in flags]
    assert not missing, f"EngineArgs fields without a flag: {missing}"
    for f in dataclasses.fields(EngineArgs):
        assert "--" + f.name.replace("_", "-") in flags[f.name]


def test_flags_are_vllm_names():
    known = {s for strings in option_strings(engine_parser()).values() for s in strings}
    assert set(VLLM_FLAGS) <= known, sorted(set(VLLM_FLAGS) - known)
    assert "--kv-cache-memory" in known  # the older name stays an alias


@pytest.mark.parametrize("sub", ["serve", "generate", "chat"])
def test_every_command_has_every_engine_flag(sub):
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = option_strings(subparsers.choices[sub])
    assert EngineArgs.field_names() <= set(flags)


def test_no_flags_give_the_dataclass_defaults():
    assert parse() == EngineArgs()


def test_flags_reach_their_fields():
    args = parse(
        *("--model", "m.gguf", "--tokenizer", "tok", "--served-model-name", "name", "--dtype", "bf16"),
        *("--seed", "7", "--max-model-len", "512", "--block-size", "32", "--kv-cache-memory", "64MiB"),
        *("--gpu-memory-utilization", "0.5", "--no-enable-prefix-caching", "--num-gpu-blocks-override", "9"),
        *("--max-num-batched-tokens", "256", "--max-num-seqs", "4", "--scheduling-policy", "priority"),
        *("--long-prefill-token-threshold", "64", "-tp", "1", "--device", "cpu", "--num-threads", "1"),
        *("--attention-backend", "torch", "--enforce-eager"),
    )
    assert args == EngineArgs(
        model="m.gguf",
        tokenizer="tok",
        served_model_name="name",
        dtype="bf16",
        seed=7,
        max_model_len=512,
        block_size=32,
        kv_cache_memory_bytes="64MiB",
        gpu_memory_utilization=0.5,
        enable_prefix_caching=False,
        num_gpu_blocks_override=9,
        max_num_batched_tokens=256,
        max_num_seqs=4,
        scheduling_policy="priority",
        long_prefill_token_threshold=64,
        tensor_parallel_size=1,
        device="cpu",
        num_threads=1,
        attention_backend="torch",
        enforce_eager=True,
    )


def test_positional_model_is_the_model():
    assert parse("a.gguf", positional_model=True).model == "a.gguf"
    assert parse("--model", "a.gguf", positional_model=True).model == "a.gguf"
    assert parse("a.gguf", "--model", "a.gguf", positional_model=True).model == "a.gguf"
    with pytest.raises(ValueError, match="two models given"):
        parse("a.gguf", "--model", "b.gguf", positional_model=True)


def test_served_model_name_takes_further_names_but_not_the_model(tmp_path):
    """vLLM's --served-model-name takes one or more names; the first is the model's name (the rest: the server's
    `served_model_name_rest`). A path among them is the model taken as a name (`--served-model-name NAME MODEL`)."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(), positional_model=True)
    ns = parser.parse_args([str(model), "--served-model-name", "a", "b"])
    assert EngineArgs.from_cli_args(ns).served_model_name == "a" and ns.served_model_name_rest == ["b"]
    ns = parser.parse_args(["--served-model-name", "a", str(model)])
    with pytest.raises(ValueError, match="took .*m.gguf.*, a model, as a further name"):
        EngineArgs.from_cli_args(ns)
    from pagedllm.model.packaged import PACKAGED_MODELS

    packaged = next(iter(PACKAGED_MODELS))  # a packaged model's name, which is no path
    with pytest.raises(ValueError, match=f"took '{packaged}', a model"):
        EngineArgs.from_cli_args(parser.parse_args(["--served-model-name", "a", packaged]))


@pytest.mark.parametrize("bad", ["0", "-0.5", "1.5"])
def test_gpu_memory_utilization_out_of_range(bad):
    args = parse("--gpu-memory-utilization", bad)
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization.*\(0, 1\]"):
        args.create_engine_config()  # refused before any model is looked for


def test_gpu_memory_utilization_sizes_the_kv_cache(model_dir, monkeypatch, caplog):
    monkeypatch.setattr(arg_utils, "available_memory_bytes", lambda device: 1000 << 20)
    monkeypatch.setattr(logging.getLogger("pagedllm"), "propagate", True)
    with caplog.at_level(logging.INFO, logger="pagedllm.engine.arg_utils"):
        config = parse(
            "--model", model_dir, "--device", "cpu", "--gpu-memory-utilization", "0.25"
        ).create_engine_config()
    assert config.cache_config.kv_cache_memory_bytes == 250 << 20
    assert str(250 << 20) in caplog.text and "--kv-cache-memory-bytes" in caplog.text


def test_kv_cache_memory_bytes_wins_over_utilization(model_dir, monkeypatch):
    monkeypatch.setattr(arg_utils, "available_memory_bytes", lambda device: 1000 << 20)
    config = parse(
        "--model", model_dir, "--gpu-memory-utilization", "0.25", "--kv-cache-memory-bytes", "16MiB"
    ).create_engine_config()
    assert config.cache_config.kv_cache_memory_bytes == 16 << 20


def test_available_memory_on_this_machine():
    assert 0 < arg_utils.available_memory_bytes("cpu")


def test_cpu_kernel_settings_come_from_the_environment(model_dir, monkeypatch):
    monkeypatch.delenv("PAGEDLLM_CPU_KERNELS", raising=False)
    monkeypatch.delenv("PAGEDLLM_CPU_ISA", raising=False)
    assert cpu_kernels_enabled() and cpu_isa() == "auto"
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "0")
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", " AVX2 ")
    device = EngineArgs(model=model_dir).create_engine_config().device_config
    assert (device.cpu_kernels, device.cpu_isa) == (False, "avx2")
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "1")
    assert cpu_kernels_enabled()
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "sse2")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_ISA.*sse2"):
        cpu_isa()
    monkeypatch.delenv("PAGEDLLM_CPU_ISA")
    monkeypatch.delenv("PAGEDLLM_PROMPT_INT8", raising=False)
    assert not EngineArgs(model=model_dir).create_engine_config().device_config.prompt_int8
    monkeypatch.setenv("PAGEDLLM_PROMPT_INT8", "1")
    assert EngineArgs(model=model_dir).create_engine_config().device_config.prompt_int8
    monkeypatch.setenv("PAGEDLLM_PROMPT_INT8", "yes")
    with pytest.raises(ValueError, match="PAGEDLLM_PROMPT_INT8 must be 0 or 1, got 'yes'"):
        EngineArgs(model=model_dir).create_engine_config()


def test_the_engine_core_gets_the_budget_sized_in_the_front_end(model_dir, monkeypatch):
    """The core process rebuilds the config from the args: free memory read twice would give two budgets."""
    free = iter([1000 << 20, 600 << 20])
    monkeypatch.setattr(arg_utils, "available_memory_bytes", lambda device: next(free))
    args = parse("--model", model_dir, "--gpu-memory-utilization", "0.5")
    core_args = args.for_engine_core()  # reads the free memory once, before either process builds its config
    assert core_args.kv_cache_memory_bytes == 500 << 20
    assert core_args.create_engine_config() == core_args.create_engine_config()
    assert core_args.create_engine_config().cache_config.kv_cache_memory_bytes == 500 << 20


def test_speculative_config_flag(model_dir):
    """--speculative-config takes vLLM's JSON; the engine config holds it parsed; a bad value is a ValueError naming
    what is wrong, before anything loads."""
    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    args = parse("--model", str(model_dir), "--speculative-config", text)
    assert args.speculative_config == text
    spec = args.create_engine_config().speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == (
        "ngram",
        3,
        4,
        2,
    )
    assert EngineArgs(model=str(model_dir)).create_engine_config().speculative_config is None
    for bad, match in [
        ('{"method": "eagle", "num_speculative_tokens": 3}', "method"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ("{not json", "JSON"),
    ]:
        with pytest.raises(ValueError, match=match):
            EngineArgs(model=str(model_dir), speculative_config=bad).create_engine_config()


def test_chat_template_from_a_file_or_inline(tiny_model_dir, tmp_path) -> None:
    """--chat-template: a Jinja file's text or an inline template replaces the model's; anything else is a
    ValueError naming it. LLM.chat renders with it."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.engine.arg_utils import resolve_chat_template
    from tests.model_utils import make_tiny_model

    inline = "{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}"
    file = tmp_path / "template.jinja"
    file.write_text(inline)
    assert resolve_chat_template(str(file)) == inline
    assert resolve_chat_template(inline) == inline
    with pytest.raises(ValueError, match="no-such-template.jinja"):
        resolve_chat_template("no-such-template.jinja")
    folder = make_tiny_model(tiny_model_dir, "LlamaForCausalLM", seed=1)
    with LLM(folder, chat_template=str(file), engine_client="inproc", kv_cache_memory_bytes="8MiB") as llm:
        out = llm.chat([{"role": "user", "content": "t5 t6"}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
        assert out.prompt == "[user] t5 t6 "
    with LLM(folder, engine_client="inproc", kv_cache_memory_bytes="8MiB") as llm:  # the tiny tokenizer has none
        with pytest.raises(ValueError, match="no chat template.*--chat-template.*/v1/completions"):
            llm.chat([{"role": "user", "content": "t5"}], SamplingParams(max_tokens=1), use_tqdm=False)
