"""LoRA adapters (pagedllm/lora/): served adapters match PEFT's own forward token for token, in float32.

Adapters are made by PEFT on a tiny random Llama and on the default model (SmolLM2-135M, de-quantized), with random
signed A and B at a scale that changes the greedy tokens (checked: each adapter's tokens differ from the base
model's). Checked: each adapter alone and a step mixing four adapters with the base model (each request gets what it
gets alone), ranks 4 to 16 with rsLoRA and a rank pattern, a subset of targets, LRU eviction under --max-cpu-loras,
prefix-cache isolation, unloading while a request runs, tensor parallel 2, the default GGUF run as stored with an
adapter, and the errors a user meets.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.config import default_model_path
from tests.lora_utils import make_peft_adapter, peft_greedy
from tests.model_utils import hf_greedy, make_tiny_model, random_prompts

pytestmark = pytest.mark.timeout(600)
NEW = 12
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
ENGINE = dict(kv_cache_memory_bytes="64MiB", max_model_len=512)


@pytest.fixture(scope="module")
def base(tiny_model_dir) -> str:
    return make_tiny_model(tiny_model_dir, "LlamaForCausalLM", num_hidden_layers=3)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> list[str]:
    """Four adapters: ranks 4, 8, 16 (rsLoRA) and one with a rank pattern on a subset of the projections."""
    root = tmp_path_factory.mktemp("adapters")
    return [
        make_peft_adapter(base, root / "r4", seed=1, rank=4, alpha=8),
        make_peft_adapter(base, root / "r8", seed=2, rank=8, alpha=32),
        make_peft_adapter(base, root / "r16-rslora", seed=3, rank=16, alpha=16, rslora=True),
        make_peft_adapter(
            base,
            root / "subset",
            seed=4,
            rank=8,
            targets=("q_proj", "v_proj", "down_proj"),
            rank_pattern={"down_proj": 4},
        ),
    ]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts([3, 17, 40], seed=11)


@pytest.fixture(scope="module")
def references(base, adapters, prompts) -> list[list[list[int]]]:
    """[adapter][prompt] PEFT's greedy tokens; the base model's last."""
    refs = [peft_greedy(base, a, prompts, NEW) for a in adapters]
    refs.append(hf_greedy(base, prompts, NEW))
    for ref in refs[:-1]:
        assert ref != refs[-1], "an adapter that does not change the tokens tests nothing"
    return refs


@pytest.fixture(scope="module")
def llm(base):
    engine = LLM(base, enable_lora=True, max_loras=4, max_lora_rank=16, engine_client="inproc", **ENGINE)
    yield engine
    engine.shutdown()


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _lora(adapters: list[str], i: int) -> LoRARequest:
    return LoRARequest(f"adapter-{i}", i + 1, adapters[i])


def test_each_adapter_matches_peft(llm, adapters, prompts, references) -> None:
    for i in range(len(adapters)):
        got = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=_lora(adapters, i)))
        assert got == references[i], f"adapter {i}"
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == references[-1]


def test_a_step_mixing_four_adapters_and_the_base_model(llm, adapters, prompts, references) -> None:
    """Every (prompt, adapter or none) pair in one batch: each request gets what it gets alone (PEFT's tokens)."""
    batch, loras, expected = [], [], []
    for p, prompt in enumerate(prompts):
        for i in range(len(adapters) + 1):
            batch.append(prompt)
            loras.append(_lora(adapters, i) if i < len(adapters) else None)
            expected.append(references[i][p])
    got = _tokens(llm.generate(batch, GREEDY, use_tqdm=False, lora_request=loras))
    assert got == expected
    assert llm.check_invariants()["in_use"] == 0


def test_the_prefix_cache_is_keyed_by_adapter(llm, adapters, prompts, references) -> None:
    """The same 40-token prompt under two adapters and the base model, one after another: none reuses another's
    cached blocks (each gets PEFT's tokens), while the same adapter again does."""
    prompt = prompts[2]
    for i in (0, 1, None, 0):
        lora = None if i is None else _lora(adapters, i)
        (out,) = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)
        assert list(out.outputs[0].token_ids) == references[-1 if i is None else i][2]
    assert out.num_cached_tokens > 0  # adapter 0's second run hit its own blocks


def test_lru_eviction_under_max_cpu_loras(base, adapters, prompts, references) -> None:
    """One slot and two adapters kept in memory: cycling through three adapters drops the least recently used one,
    and a request naming it again reloads it from its path (still PEFT's tokens)."""
    with LLM(base, enable_lora=True, max_loras=1, max_cpu_loras=2, engine_client="inproc", **ENGINE) as llm:
        for i in (0, 1, 2, 0):
            got = _tokens(llm.generate(prompts[:2], GREEDY, use_tqdm=False, lora_request=_lora(adapters, i)))
            assert got == [references[i][0], references[i][1]], f"adapter {i}"
            assert len(llm.list_loras()) <= 2
        assert llm.list_loras() == [1, 3]  # 0 again (reloaded) and 2; 1 was the least recently used
        # Two adapters in one call with one slot: they take turns (the scheduler keeps one adapter running).
        got = _tokens(
            llm.generate(prompts[:2], GREEDY, use_tqdm=False, lora_request=[_lora(adapters, 0), _lora(adapters, 1)])
        )
        assert got == [references[0][0], references[1][1]]


def test_unloading_an_adapter_in_use_lets_its_requests_finish(base, adapters, prompts, references) -> None:
    with LLM(base, enable_lora=True, engine_client="inproc", **ENGINE) as llm:
        lora = _lora(adapters, 1)
        _, req = llm.input_processor.process("r", prompts[1], GREEDY, lora_request=lora)
        llm.add_lora(lora)
        llm._add(None, req)
        finished = []

        def step() -> None:
            outputs = llm.engine_core.get_output().outputs
            finished.extend(o for o in llm.output_processor.process_outputs(outputs).request_outputs if o.finished)

        step()  # its prompt
        assert llm.remove_lora(lora.lora_int_id)
        assert llm.list_loras() == [lora.lora_int_id]  # kept while its request runs
        while llm.output_processor.has_unfinished_requests():
            step()
        assert list(finished[0].outputs[0].token_ids) == references[1][1]
        assert llm.list_loras() == []  # dropped once it finished
        assert not llm.remove_lora(lora.lora_int_id)
        # Named again, it is loaded again.
        assert _tokens(llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=lora)) == [references[1][0]]


def test_tensor_parallel_2(base, adapters, prompts, references) -> None:
    """At -tp 2 (worker processes) each rank holds its cut of B (column-parallel) or A (row-parallel)."""
    loras = [_lora(adapters, i) for i in (0, 2, 3)] + [None]
    with LLM(base, enable_lora=True, max_loras=3, tensor_parallel_size=2, **ENGINE) as llm:
        got = _tokens(llm.generate([prompts[1]] * 4, GREEDY, use_tqdm=False, lora_request=loras))
    assert got == [references[0][1], references[2][1], references[3][1], references[-1][1]]


def test_errors_are_clear_and_leave_the_engine_serving(llm, base, adapters, prompts, references, tmp_path) -> None:
    def refused(lora: LoRARequest, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=lora)

    refused(LoRARequest("missing", 50, str(tmp_path / "nowhere")), "no adapter_config.json")
    big = make_peft_adapter(base, tmp_path / "r32", seed=5, rank=32)
    refused(LoRARequest("big", 51, big), "rank 32 .* above --max-lora-rank 16")
    llm.add_lora(_lora(adapters, 0))
    refused(LoRARequest("other-name", 1, adapters[1]), "lora_int_id 1 is adapter 'adapter-0'")
    # An adapter of another model's shapes (a wider hidden size).
    other = make_tiny_model(tmp_path, "LlamaForCausalLM", num_hidden_layers=3, hidden_size=96)
    refused(LoRARequest("wrong-shapes", 52, make_peft_adapter(other, tmp_path / "wide", seed=6)), "does not fit")
    # An adapter that also trains the head (modules_to_save).
    saved = tmp_path / "saves-head"
    os.makedirs(saved)
    with open(os.path.join(adapters[0], "adapter_config.json")) as f:
        config = json.load(f)
    config["modules_to_save"] = ["lm_head"]
    with open(saved / "adapter_config.json", "w") as f:
        json.dump(config, f)
    os.symlink(os.path.join(adapters[0], "adapter_model.safetensors"), saved / "adapter_model.safetensors")
    refused(LoRARequest("saves-head", 53, str(saved)), "modules_to_save")
    with pytest.raises(ValueError, match="must be a LoRARequest"):
        llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=["adapter-0"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="lora_int_id must be an integer > 0"):
        LoRARequest("zero", 0, adapters[0])
    # The engine serves on.
    assert _tokens(llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=_lora(adapters, 0))) == [
        references[0][0]
    ]
    assert llm.check_invariants()["in_use"] == 0


def test_without_enable_lora_a_lora_request_is_refused(base, adapters, prompts) -> None:
    with LLM(base, engine_client="inproc", **ENGINE) as llm:
        with pytest.raises(ValueError, match="without --enable-lora"):
            llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=_lora(adapters, 0))
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(base, enable_lora=True, max_loras=2, max_cpu_loras=1, engine_client="inproc", **ENGINE)


# ---- the default model ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_hf():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()


def test_default_model_adapters_match_peft_and_run_on_the_gguf_as_stored(smollm2_hf, tmp_path) -> None:
    """Rank-16 adapters on all seven projections of SmolLM2: float32 (the GGUF de-quantized) matches PEFT token for
    token; the GGUF run as stored (quantized weights in the native kernels, the adapter beside them) gives the
    adapter's first token and differs from the base model's output."""
    adapters = [make_peft_adapter(smollm2_hf, tmp_path / f"s{i}", seed=20 + i, rank=16, std=0.15) for i in range(2)]
    path = default_model_path()
    with LLM(path, quantization="none", engine_client="inproc", enable_lora=True, max_loras=2, **ENGINE) as llm:
        tok = llm.get_tokenizer()
        prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
        base_tokens = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
        loras = [LoRARequest(f"s{i}", i + 1, a) for i, a in enumerate(adapters)]
        float32 = {}
        for i, lora in enumerate(loras):
            got = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora))
            assert got == peft_greedy(smollm2_hf, adapters[i], prompts, NEW), f"adapter {i}"
            assert got != base_tokens
            float32[i] = got
    with LLM(path, engine_client="inproc", enable_lora=True, max_loras=2, **ENGINE) as llm:
        stored_base = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
        for i, lora in enumerate(loras):
            got = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora))
            assert [g[0] for g in got] == [f[0] for f in float32[i]], f"adapter {i}"
            assert got != stored_base
        # Mixed with the base model in one batch: each request as alone.
        mixed = _tokens(
            llm.generate(prompts * 2, GREEDY, use_tqdm=False, lora_request=[loras[0], loras[1], None, None])
        )
        alone = [_tokens(llm.generate([prompts[0]], GREEDY, use_tqdm=False, lora_request=loras[0]))[0]]
        assert mixed[0] == alone[0]
        assert mixed[2:] == stored_base


def test_adapter_decode_rows_run_in_the_fused_decoder(llm, adapters, prompts, references) -> None:
    """Decode steps of requests with adapters go through the fused decoder (their slots passed with the rows),
    mixed with base-model rows in one call, and give PEFT's tokens."""
    runner = llm.engine_core.engine_core.executor.worker.model_runner
    fused = runner.decode_runner
    assert fused is not None
    calls: list[list[int]] = []
    original = fused.__call__

    def spy(*args, **kwargs):
        slots = kwargs.get("lora_slots")
        calls.append([] if slots is None else slots.tolist())
        return original(*args, **kwargs)

    runner.decode_runner = type("Spy", (), {"__call__": staticmethod(spy), "max_rows": fused.max_rows})()
    try:
        loras = [_lora(adapters, 0), None, _lora(adapters, 2)]
        got = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    finally:
        runner.decode_runner = fused
    assert got == [references[0][0], references[-1][1], references[2][2]]
    mixed = [c for c in calls if c and -1 in c and any(s >= 0 for s in c)]
    assert mixed, calls  # a call carrying rows of adapters and of the base model


def test_an_id_freed_by_unloading_can_name_another_adapter(llm, adapters, prompts, references) -> None:
    first, second = LoRARequest("first", 7, adapters[0]), LoRARequest("second", 7, adapters[1])
    assert _tokens(llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=first)) == [references[0][0]]
    assert llm.remove_lora(7)
    assert _tokens(llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=second)) == [references[1][0]]
