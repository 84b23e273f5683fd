"""The tokens that end a request besides the tokenizer's eos: a generation config's `eos_token_id` list (vLLM's
rule: Llama 3's <|eom_id|>, Phi-3's <|end|>), and for a GGUF file, which names one eos, the special tokens
llama.cpp ends generation on by their text (Gemma's <end_of_turn>, Phi-3's <|end|>, ChatML's <|endoftext|>;
gpt-oss's <|return|> and <|call|>, where <|end|> only ends a message). They join each request's stop tokens unless
it ignores eos, so a stop there reports the token id as its stop_reason, as vLLM does."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

from pagedllm import LLM, SamplingParams
from pagedllm.model.generation_config import generation_eos_ids
from pagedllm.tokenizer import end_token_ids
from tests.model_utils import make_tiny_model

TINY = dict(max_model_len=256, kv_cache_memory_bytes="8MiB", num_threads=1, engine_client="inproc")


def test_the_generation_configs_eos_ids(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128008, 128009]}))
    assert generation_eos_ids("auto", str(tmp_path)) == (128001, 128008, 128009)
    assert generation_eos_ids("vllm", str(tmp_path)) == ()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    assert generation_eos_ids("auto", str(tmp_path)) == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.5}))
    assert generation_eos_ids("auto", str(tmp_path)) == ()
    assert generation_eos_ids("auto", str(tmp_path / "none")) == ()


class _Tokenizer:
    def __init__(self, added: dict[str, int]) -> None:
        self.added = added

    def get_added_vocab(self) -> dict[str, int]:
        return self.added


def _mc(gguf: bool, eos_ids: tuple[int, ...] = (), vocab: int = 1000, **hf):
    gguf_file = "m.gguf" if gguf else None
    return SimpleNamespace(
        gguf_file=gguf_file, generation_eos_ids=eos_ids, vocab_size=vocab, hf_config=SimpleNamespace(**hf)
    )


def test_the_rules_for_gguf_files_and_folders():
    phi3 = _Tokenizer({"<|endoftext|>": 32, "<|end|>": 37, "<|user|>": 40, "<|assistant|>": 42})
    assert end_token_ids(phi3, _mc(True), 32) == [37]  # the eos itself is not repeated
    assert end_token_ids(phi3, _mc(False), 32) == []  # a folder: its generation config only
    assert end_token_ids(phi3, _mc(False, (32, 37, 40)), 32) == [37, 40]
    # a generation config's ids that are ordinary tokens here (another model's, e.g. Llama 3's 128009 for Qwen)
    assert end_token_ids(phi3, _mc(False, (37, 38, 500)), 32) == [37]
    assert end_token_ids(phi3, _mc(True, eot_token_id=40, eom_token_id=None), 32) == [40, 37]  # the file's own eot
    harmony = _Tokenizer({"<|return|>": 200, "<|call|>": 212, "<|end|>": 207, "<|endoftext|>": 199})
    assert sorted(end_token_ids(harmony, _mc(True, vocab=300), 199)) == [200, 212]  # <|end|> ends a message only
    assert sorted(end_token_ids(harmony, _mc(True, vocab=300, eot_token_id=207), 199)) == [200, 212]  # also as eot
    assert end_token_ids(harmony, _mc(True, (500,), vocab=201), 199) == [200]  # inside the vocabulary only
    plain_text = _Tokenizer({})  # "</s>" or "<|im_end|>" as ordinary pieces of the vocabulary: not special
    assert end_token_ids(plain_text, _mc(True), 2) == []


def test_the_default_gguf_also_ends_at_its_endoftext():
    """SmolLM2's file names <|im_end|> (2) as eos; <|endoftext|> (0) ends a request too, as in llama.cpp."""
    with LLM(**TINY | {"num_threads": 2}) as llm:
        assert llm.input_processor.end_token_ids == [0]
        forced = {0: 100.0}  # the model's first token is then <|endoftext|>
        out = llm.generate("Hello", SamplingParams(max_tokens=4, logit_bias=forced), use_tqdm=False)[0].outputs[0]
        assert (out.token_ids, out.finish_reason, out.stop_reason, out.text) == ([0], "stop", 0, "")
        params = SamplingParams(max_tokens=3, logit_bias=forced, ignore_eos=True)
        out = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
        assert (out.token_ids, out.finish_reason) == ([0, 0, 0], "length")
        params = SamplingParams(max_tokens=4, logit_bias=forced, stop_token_ids=[5])  # the caller's stay first
        stops = [llm.input_processor.process("r", "Hi", p)[1].sampling_params.stop_token_ids
                 for p in (params, params.clone(ignore_eos=True))]  # fmt: skip
        assert stops == [[5, 0], [5]]
        assert llm.generate("Hello", params, use_tqdm=False)[0].outputs[0].stop_reason == 0


def test_a_folders_generation_config_eos_list_ends_requests(tiny_model_dir, tmp_path):
    folder = tmp_path / "llama"
    shutil.copytree(make_tiny_model(tiny_model_dir, "LlamaForCausalLM"), folder)
    config = json.loads((folder / "generation_config.json").read_text())
    eos = config["eos_token_id"]
    config["eos_token_id"] = [eos, 1, 77]  # <s> (a special token of this vocabulary) and t77 (an ordinary one)
    (folder / "generation_config.json").write_text(json.dumps(config))
    with LLM(str(folder), **TINY) as llm:
        assert llm.input_processor.end_token_ids == [1]
        params = SamplingParams(max_tokens=5, logit_bias={1: 100.0})
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0].outputs[0]
        assert (out.token_ids, out.finish_reason, out.stop_reason) == ([1], "stop", 1)
    with LLM(str(folder), generation_config="vllm", **TINY) as llm:  # no generation config: no more ends
        assert llm.input_processor.end_token_ids == []


def test_beam_search_ends_a_beam_at_any_end_token():
    from pagedllm.beam_search import BeamSearch
    from pagedllm.outputs import Logprob
    from pagedllm.sampling_params import BeamSearchParams

    search = BeamSearch([[1, 2]], BeamSearchParams(beam_width=1, max_tokens=3), [2, 7], 100, 20)
    assert search.pending() == [[1, 2]]
    search.advance([{7: Logprob(-0.1, 1, "x"), 9: Logprob(-3.0, 2, "y")}])
    assert [b.tokens for b in search.done[0]] == [[1, 2, 7]] and search.done[0][0].finish_reason == "stop"
