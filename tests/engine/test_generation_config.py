"""--generation-config (vLLM's): a model's generation_config.json supplies the sampling values a request leaves unset
(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens), with "auto" (the model's
folder, or the folder of a GGUF file), "vllm" (none) or a folder; values equal to transformers' defaults are no
recommendation. Offline, `LLM.get_default_sampling_params()` is what `generate` runs without params; on the server,
a value the request sets wins over the config's."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import default_model_path
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.model.generation_config import sampling_defaults
from tests.model_utils import make_tiny_model

TINY = dict(max_model_len=256, kv_cache_memory_bytes="8MiB", num_threads=1)


def _write(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def greedy_model(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny Llama, with a generation config that asks for greedy decoding of 5 tokens and sets top_p."""
    folder = tmp_path_factory.mktemp("gen_config") / "llama"
    shutil.copytree(make_tiny_model(tiny_model_dir, "LlamaForCausalLM"), folder)
    config = json.loads((folder / "generation_config.json").read_text())  # transformers wrote bos/eos/pad ids
    config.update(temperature=0.0, top_p=0.8, top_k=50, repetition_penalty=1.0, max_new_tokens=5, do_sample=False)
    _write(folder, config)
    return str(folder)


def test_the_values_read_and_the_ones_left_out(tmp_path):
    folder = _write(
        tmp_path / "m",
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
         "max_new_tokens": 300, "do_sample": True, "bos_token_id": 1},
    )  # fmt: skip
    want = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
    assert sampling_defaults("auto", str(folder)) == (
        {**want, "max_tokens": 300},
        str(folder / "generation_config.json"),
    )
    assert sampling_defaults("vllm", str(folder)) == ({}, None)
    assert sampling_defaults(str(folder), str(tmp_path)) == (
        {**want, "max_tokens": 300},
        str(folder / "generation_config.json"),
    )
    assert sampling_defaults("auto", str(tmp_path)) == ({}, None)  # no file: nothing
    # transformers' own defaults and nulls are no recommendation (vLLM reads the config's diff from them)
    hf = _write(
        tmp_path / "hf", {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0, "min_p": None}
    )
    assert sampling_defaults("auto", str(hf)) == ({}, str(hf / "generation_config.json"))
    for bad, match in [
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"top_k": 2.5}, "top_k must be an integer"),
    ]:
        with pytest.raises(ValueError, match=match):
            sampling_defaults("auto", str(_write(tmp_path / "bad", bad)))
    (tmp_path / "bad" / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        sampling_defaults("auto", str(tmp_path / "bad"))
    with pytest.raises(ValueError, match="has no generation_config.json"):
        sampling_defaults(str(tmp_path / "hf" / ".."), str(tmp_path))


def test_engine_args_choose_the_source(greedy_model, tmp_path):
    mc = EngineArgs(model=greedy_model).create_model_config()
    assert mc.get_diff_sampling_param() == {"temperature": 0.0, "top_p": 0.8, "max_tokens": 5}
    assert EngineArgs(model=greedy_model, generation_config="vllm").create_model_config().sampling_defaults == {}
    other = _write(tmp_path / "other", {"min_p": 0.2})
    assert EngineArgs(model=greedy_model, generation_config=str(other)).create_model_config().sampling_defaults == {
        "min_p": 0.2
    }
    with pytest.raises(ValueError, match="generation_config must be auto, vllm or a folder"):
        EngineArgs(model=greedy_model, generation_config=str(tmp_path / "nope")).for_engine_core()
    with pytest.raises(ValueError, match="top_p must be in"):  # the values must make valid SamplingParams
        EngineArgs(
            model=greedy_model, generation_config=str(_write(tmp_path / "bad", {"top_p": 2.0}))
        ).create_model_config()


def test_a_gguf_takes_the_generation_config_beside_it(tmp_path):
    """A GGUF carries no sampling defaults: "auto" reads a generation_config.json in the file's folder, if any."""
    (tmp_path / "model.gguf").symlink_to(default_model_path())
    assert EngineArgs(model=str(tmp_path / "model.gguf")).create_model_config().sampling_defaults == {}
    _write(tmp_path, {"temperature": 0.2, "max_new_tokens": 64})
    mc = EngineArgs(model=str(tmp_path / "model.gguf")).create_model_config()
    assert mc.sampling_defaults == {"temperature": 0.2, "max_tokens": 64}
    assert mc.sampling_defaults_source == os.path.join(tmp_path, "generation_config.json")


def test_a_ggufs_own_sampling_metadata_is_its_generation_config(tiny_model_dir, tmp_path):
    """A GGUF whose converter copied the model's generation config into `general.sampling.*` (as llama.cpp's does
    since 2025) gets those values with "auto", where no generation_config.json lies beside it; float32 values read
    as the JSON values they came from, and the same rules apply (top_k 50 is transformers' default)."""
    from tests.gguf_utils import write_gguf

    folder = make_tiny_model(tiny_model_dir, "LlamaForCausalLM")
    path = str(tmp_path / "with-sampling.gguf")
    write_gguf(folder, path, "F32", sampling={"temp": 0.7, "top_p": 0.8, "min_p": 0.05, "penalty_repeat": 1.05})
    mc = EngineArgs(model=path, tokenizer=folder).create_model_config()
    assert mc.sampling_defaults == {"temperature": 0.7, "top_p": 0.8, "min_p": 0.05, "repetition_penalty": 1.05}
    assert mc.sampling_defaults_source == f"the sampling metadata of {path}"
    assert (
        EngineArgs(model=path, tokenizer=folder, generation_config="vllm").create_model_config().sampling_defaults == {}
    )
    other = str(tmp_path / "top-k.gguf")
    write_gguf(folder, other, "F32", sampling={"top_k": 50, "temp": 1.0})
    assert EngineArgs(model=other, tokenizer=folder).create_model_config().sampling_defaults == {}
    write_gguf(folder, other, "F32", sampling={"top_k": 0, "temp": 0.2})  # top_k 0: llama.cpp's "off"
    assert EngineArgs(model=other, tokenizer=folder).create_model_config().sampling_defaults == {"temperature": 0.2}
    _write(tmp_path, {"temperature": 0.3})  # a generation_config.json beside the file wins
    assert EngineArgs(model=path, tokenizer=folder).create_model_config().sampling_defaults == {"temperature": 0.3}
    write_gguf(folder, other, "F32", sampling={"top_p": 2.0})
    os.remove(tmp_path / "generation_config.json")
    with pytest.raises(ValueError, match="sampling metadata of .*top_p"):
        EngineArgs(model=other, tokenizer=folder).create_model_config()


def test_llm_generate_without_params_runs_the_configs_defaults(greedy_model, caplog):
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        llm = LLM(greedy_model, engine_client="inproc", **TINY)
    with llm:
        assert any("Default sampling parameters have been overridden" in r.getMessage() for r in caplog.records)
        greedy = SamplingParams(temperature=0.0, top_p=0.8, max_tokens=5)  # the rest: SamplingParams' defaults
        assert llm.get_default_sampling_params() == greedy
        prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [40, 41]}]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, use_tqdm=False)]
        assert got == [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert all(0 < len(t) <= 5 for t in got)
    plain = LLM(greedy_model, engine_client="inproc", generation_config="vllm", **TINY)
    with plain:
        assert plain.get_default_sampling_params() == SamplingParams()


def _serving(defaults: dict, max_model_len: int = 100):
    from pagedllm.entrypoints.openai.serving_engine import OpenAIServing

    model_config = SimpleNamespace(max_model_len=max_model_len, sampling_defaults=defaults)
    return OpenAIServing(SimpleNamespace(model_config=model_config, tokenizer=None), ["m"])


def test_the_server_fills_what_a_request_leaves_unset():
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion

    defaults = {"temperature": 0.3, "top_p": 0.9, "top_k": 7, "min_p": 0.1, "repetition_penalty": 1.2, "max_tokens": 12}
    serving = _serving(defaults)
    unset = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    params = serving.sampling_params(unset, serving.resolve_max_tokens(None, 10, "messages"), None)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.3, 0.9, 7, 0.1)
    assert (params.repetition_penalty, params.max_tokens) == (1.2, 12)
    given = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], temperature=0, top_p=1, top_k=0, min_p=0, repetition_penalty=1
    )
    params = serving.sampling_params(given, serving.resolve_max_tokens(40, 10, "messages"), None)
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == (0, 1, -1, 0, 1)
    assert params.max_tokens == 40
    assert serving.resolve_max_tokens(None, 95, "messages") == 5  # the context's rest, where it is less
    assert _serving({}).resolve_max_tokens(None, 10, "messages") == 90
    # completions: OpenAI's default of 16, lowered by the config (vLLM takes the least); a given value wins
    completion = OpenAIServingCompletion(serving.engine, ["m"])
    completion.engine.input_processor = SimpleNamespace(
        tokenize=lambda text, special: [5] * 3, validate=lambda *a: None
    )
    for body, want in [({}, 12), ({"max_tokens": 30}, 30), ({"max_tokens": None}, 12)]:
        prompt = completion._prepare(CompletionRequest(prompt="t5 t6 t7", **body))[0]
        assert prompt.params.max_tokens == want, body
