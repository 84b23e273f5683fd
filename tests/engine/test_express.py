"""The express lane of an encoder pooling model (engine/core.py `install_express`, core_proc.py `_express_poll`), on
all-MiniLM-L6-v2: a short call that arrives while a step runs is computed between two of the step's layers, in a step
of its own, with the same result as alone, and the step it interrupted comes out as it would have without it."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedllm import LLM
from pagedllm.config import express_tokens
from pagedllm.engine.core_proc import EngineCoreProc
from pagedllm.engine.protocol import EngineCoreOutput, EngineCoreRequestType
from pagedllm.pooling_params import PoolingParams
from tests.engine.test_pooling import minilm_folder

QUERY = "What is the capital of France?"


def _docs(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["river", "market", "signal", "granite", "orchestra", "ledger", "harbor", "velvet", "quantum", "meadow"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(20, 60))) for _ in range(n)]


@pytest.fixture(scope="module")
def llm():
    # As many rows as the step of 12 documents and one query need: several express steps in one step must give
    # back their rows.
    with LLM(minilm_folder(), engine_client="inproc", max_num_batched_tokens=1024, max_num_seqs=13) as llm:
        yield llm


def _request(llm: LLM, rid: str, text: str, call_tokens: int | None):
    return llm.input_processor.process_pooling(rid, text, PoolingParams(task="embed", call_tokens=call_tokens))[1]


def _vector(out: EngineCoreOutput) -> np.ndarray:
    assert out.pooling_output is not None and out.finished
    return np.frombuffer(out.pooling_output.data, dtype=np.float32)


def _run(core) -> dict[str, np.ndarray]:
    got: dict[str, np.ndarray] = {}
    while core.has_unfinished_requests():
        got.update((o.request_id, _vector(o)) for o in core.step().outputs)
    return got


def test_a_short_call_runs_between_two_layers_and_changes_nothing_else(llm: LLM) -> None:
    core = llm.engine_core.engine_core
    docs = _docs(12, seed=1)
    core.add_request(_request(llm, "query-alone", QUERY, None))
    alone = _run(core)["query-alone"]
    for i, doc in enumerate(docs):
        core.add_request(_request(llm, f"plain-{i}", doc, 10_000))
    plain = _run(core)

    polls: list[int] = []
    express: list[EngineCoreOutput] = []

    def poll() -> None:
        polls.append(len(polls))
        if len(polls) <= 3:  # a query in each of the first three gaps between layers
            core.add_request(_request(llm, f"query-{len(polls)}", QUERY, 9))
        if len(polls) == 2:
            core.add_request(_request(llm, "late-doc", docs[0], 10_000))  # a long call's input: the next step
        express.extend(core.express_step().outputs)

    assert core.install_express(poll)
    try:
        for i, doc in enumerate(docs):
            core.add_request(_request(llm, f"doc-{i}", doc, 10_000))
        first = core.step()
        layers = len(core.executor.worker.model_runner.model.layers)
        assert len(polls) == 3 * layers - 1  # between layers, twice within each; not in the express steps
        assert [o.request_id for o in express] == ["query-1", "query-2", "query-3"]
        for out in express:
            assert np.array_equal(_vector(out), alone)  # the same bits as the query alone
        outs = {o.request_id: _vector(o) for o in first.outputs}
        assert sorted(outs) == sorted(f"doc-{i}" for i in range(len(docs)))
        for i in range(len(docs)):  # the interrupted step's results are those of the same step without the lane
            assert np.array_equal(outs[f"doc-{i}"], plain[f"plain-{i}"])
        rest = _run(core)
        assert list(rest) == ["late-doc"]
        assert np.allclose(rest["late-doc"], plain["plain-0"], atol=1e-5)
    finally:
        core.executor.collective_rpc("set_poll_hook", (None,))
        core._express_poll = None
    assert llm.check_invariants()["in_use"] == 0


def test_the_process_poll_defers_what_is_not_a_new_request(llm: LLM, tmp_path) -> None:
    """EngineCoreProc's poll (the process's busy loop calls it between layers): new requests join at once and a short
    call runs; an abort, and every message after it, wait for the end of the step, in order."""
    core = llm.engine_core.engine_core
    proc = EngineCoreProc(b"{}", f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", b"test-core")
    try:
        proc.engine_core = core
        assert core.install_express(proc._express_poll)
        for i, doc in enumerate(_docs(6, seed=2)):
            core.add_request(_request(llm, f"doc-{i}", doc, 10_000))
        proc.input_queue.put((EngineCoreRequestType.ADD, _request(llm, "query", QUERY, 9)))
        proc.input_queue.put((EngineCoreRequestType.ABORT, ["doc-5"]))
        proc.input_queue.put((EngineCoreRequestType.ADD, _request(llm, "after-abort", QUERY, 9)))
        out = core.step()
        express = proc.output_queue.get_nowait()
        assert [o.request_id for o in express.outputs] == ["query"]
        assert proc.output_queue.empty()
        assert sorted(o.request_id for o in out.outputs) == [f"doc-{i}" for i in range(6)]  # the abort waited
        assert [kind for kind, _ in proc._deferred] == [EngineCoreRequestType.ABORT, EngineCoreRequestType.ADD]
        while proc._deferred:
            proc._handle(*proc._deferred.popleft())
        assert [o.request_id for o in core.step().outputs] == ["after-abort"]
        assert not core.has_unfinished_requests()
    finally:
        core.executor.collective_rpc("set_poll_hook", (None,))
        core._express_poll = None
        proc.dealer.close(linger=0)
        proc.push.close(linger=0)
        proc.ctx.term()
    assert llm.check_invariants()["in_use"] == 0


def test_the_lane_is_off_at_zero_tokens_and_a_bad_setting_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("PAGEDLLM_EXPRESS_TOKENS", "0")
    with LLM(minilm_folder(), engine_client="inproc") as off:
        assert not off.engine_core.engine_core.install_express(lambda: None)
    monkeypatch.setenv("PAGEDLLM_EXPRESS_TOKENS", "lots")
    with pytest.raises(ValueError, match="PAGEDLLM_EXPRESS_TOKENS must be a whole number of tokens"):
        express_tokens()
