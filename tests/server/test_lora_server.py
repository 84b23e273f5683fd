"""LoRA adapters behind a real server: --lora-modules, `model` naming an adapter, /v1/models with `parent`, adapters
loaded and unloaded at run time (PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING=1) with their 400/404s, the
lora_requests_info gauge. The reference is PEFT's greedy continuation of the same adapter over the same tiny model.
"""

from __future__ import annotations

import threading

import pytest

from tests.lora_utils import make_peft_adapter, peft_greedy
from tests.model_utils import hf_greedy, make_tiny_model, random_prompts
from tests.server.server_utils import API_KEY, RemoteServer

pytestmark = pytest.mark.timeout(300, method="signal")
NEW = 10
TINY = ("--max-model-len", "512")  # the tiny model's context


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("lora-server"), "LlamaForCausalLM", num_hidden_layers=2)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-server-adapters")
    return {name: make_peft_adapter(base, root / name, seed=seed, rank=8) for name, seed in (("one", 1), ("two", 2))}


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return random_prompts([12], seed=5)[0]


@pytest.fixture(scope="module")
def server(base, adapters):
    srv = RemoteServer(
        base,
        *TINY,
        "--enable-lora",
        "--max-loras",
        "2",
        "--lora-modules",
        f"one={adapters['one']}",
        "--enable-debug-routes",
        api_key=API_KEY,
        env={"PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    )
    yield srv
    srv.stop()


def _complete(server, model: str, prompt: list[int]) -> tuple[int, object]:
    body = {"model": model, "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True}
    return server.request("POST", "/v1/completions", body)


def _token_ids(server, model: str, prompt: list[int]) -> list[int]:
    """The completion's token ids (vLLM's return_token_ids)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": NEW,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    status, out = server.request("POST", "/v1/completions", body)
    assert status == 200, out
    return out["choices"][0]["token_ids"]


def test_adapters_by_model_name_match_peft(server, base, adapters, prompt) -> None:
    base_name = server.client().models.list().data[0].id
    assert _token_ids(server, "one", prompt) == peft_greedy(base, adapters["one"], [prompt], NEW)[0]
    assert _token_ids(server, base_name, prompt) == hf_greedy(base, [prompt], NEW)[0]
    status, out = _complete(server, "nope", prompt)
    assert status == 404 and "does not exist" in out["error"]["message"]


def test_models_list_the_adapters_with_their_parent(server, adapters) -> None:
    cards = {m.id: m for m in server.client().models.list().data}
    base_name = next(name for name, card in cards.items() if card.parent is None)
    assert cards["one"].parent == base_name and cards["one"].root == adapters["one"]


def test_load_use_unload_reload_at_run_time(server, base, adapters, prompt, tmp_path) -> None:
    load = lambda body: server.request("POST", "/v1/load_lora_adapter", body)  # noqa: E731
    unload = lambda body: server.request("POST", "/v1/unload_lora_adapter", body)  # noqa: E731
    assert load({"lora_name": "two", "lora_path": adapters["two"]}) == (
        200,
        "Success: LoRA adapter 'two' added successfully.",
    )
    expected = peft_greedy(base, adapters["two"], [prompt], NEW)[0]
    assert _token_ids(server, "two", prompt) == expected
    assert "two" in {m.id for m in server.client().models.list().data}
    # The errors: a name in use, a bad path, a rank above --max-lora-rank, an unknown name.
    status, out = load({"lora_name": "two", "lora_path": adapters["one"]})
    assert status == 400 and "already been loaded" in out["error"]["message"]
    status, out = load({"lora_name": "three", "lora_path": str(tmp_path / "missing")})
    assert status == 400 and "no adapter_config.json" in out["error"]["message"]
    big = make_peft_adapter(base, tmp_path / "r32", seed=9, rank=32)
    status, out = load({"lora_name": "big", "lora_path": big})
    assert status == 400 and "above --max-lora-rank 16" in out["error"]["message"]
    status, out = unload({"lora_name": "three"})
    assert status == 404 and "cannot be found" in out["error"]["message"]
    root = next(m.root for m in server.client().models.list().data if m.parent is None)
    status, out = load({"lora_name": root, "lora_path": adapters["one"]})  # a name requests give the base model
    assert status == 400 and "is the base model's" in out["error"]["message"]
    # Unload, then the name is unknown; load it again and it serves as before.
    assert unload({"lora_name": "two"}) == (200, "Success: LoRA adapter 'two' removed successfully.")
    assert _complete(server, "two", prompt)[0] == 404
    assert "two" not in {m.id for m in server.client().models.list().data}
    assert load({"lora_name": "two", "lora_path": adapters["two"]})[0] == 200
    assert _token_ids(server, "two", prompt) == expected
    server.wait_idle()


def test_unloading_while_a_request_runs_lets_it_finish(server, base, adapters, prompt) -> None:
    """A long request of adapter "one" in flight while "one" is unloaded: it finishes with PEFT's tokens."""
    result: dict[str, object] = {}
    body = {"model": "one", "prompt": prompt, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    body["return_token_ids"] = True

    def run() -> None:
        result["out"] = server.request("POST", "/v1/completions", body, timeout=120)

    worker = threading.Thread(target=run)
    worker.start()
    while server.kv()["in_use"] == 0 and worker.is_alive():
        pass
    assert server.request("POST", "/v1/unload_lora_adapter", {"lora_name": "one"})[0] == 200
    worker.join(120)
    status, out = result["out"]
    assert status == 200, out
    expected = peft_greedy(base, adapters["one"], [prompt], 200)[0]
    assert out["choices"][0]["token_ids"] == expected
    assert server.request("POST", "/v1/load_lora_adapter", {"lora_name": "one", "lora_path": adapters["one"]})[0] == 200


def test_the_lora_gauge_names_running_adapters(server) -> None:
    status, text = server.request("GET", "/metrics")
    assert status == 200
    lines = [line for line in text.splitlines() if line.startswith("pagedllm:lora_requests_info{")]
    assert lines and 'max_lora="2"' in lines[-1], lines


def test_runtime_routes_need_the_environment_variable(base, adapters) -> None:
    srv = RemoteServer(base, *TINY, "--enable-lora", api_key=API_KEY)
    try:
        status, _ = srv.request("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": adapters["one"]})
        assert status == 404
    finally:
        srv.stop()


def test_bad_lora_modules_stop_the_server_with_a_clear_error(base, tmp_path) -> None:
    srv = RemoteServer(base, *TINY, "--lora-modules", "x=/nowhere", start=False)
    assert srv.proc.wait(120) != 0
    assert "--lora-modules needs --enable-lora" in srv.log_text()
    srv = RemoteServer(base, *TINY, "--enable-lora", "--lora-modules", f"x={tmp_path / 'nowhere'}", start=False)
    assert srv.proc.wait(120) != 0
    assert "no adapter_config.json" in srv.log_text()
