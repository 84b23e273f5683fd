"""The GGUF reader the config and the weights share (model/gguf_file.py) against gguf's own reader, on a file written
here: a vocabulary of more tokens than LAZY_ARRAY_MIN_ITEMS (strings of varied lengths, non-ASCII too), its scores and
types, short arrays, scalars, an alignment, and tensors. The large arrays are skipped over (their lengths kept), every
other field and every tensor is read as gguf reads it; the full reader (for transformers' tokenizer conversion) gives
every field's parts as gguf does. And rotary tables computed from the same values are one
tensor (model/layers/rotary.py)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedllm.model.gguf_file import LAZY_ARRAY_MIN_ITEMS, fast_full_reader, open_gguf, release_gguf_readers
from pagedllm.model.layers.rotary import RotaryEmbedding, forget_tables


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("gguf_file") / "vocab.gguf")
    rng = np.random.default_rng(0)
    n = LAZY_ARRAY_MIN_ITEMS + 1234
    tokens = ["".join(rng.choice(list("abcé日x "), size=int(k))) + str(i) for i, k in enumerate(rng.integers(0, 9, n))]
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_string("general.name", "tiny ✓")
    w.add_token_list(tokens)
    w.add_token_scores(rng.standard_normal(n).astype(np.float32).tolist())
    w.add_token_types([1] * n)
    w.add_array("general.tags", ["a", "bb"])  # short: parsed as usual
    w.add_array("llama.small_ints", [3, 1, 4])
    w.add_custom_alignment(64)
    w.add_tensor("token_embd.weight", rng.standard_normal((7, 5)).astype(np.float32))
    w.add_tensor("blk.0.attn_q.weight", rng.standard_normal((3, 5)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_fields_and_tensors_as_gguf_reads_them(gguf_path):
    release_gguf_readers()
    ours, theirs = open_gguf(gguf_path), gguf.GGUFReader(gguf_path)
    try:
        assert list(ours.fields) == list(theirs.fields)
        for key, field in theirs.fields.items():
            mine = ours.fields[key]
            assert len(mine.data) == len(field.data), key
            if len(field.data) > LAZY_ARRAY_MIN_ITEMS:
                assert mine.types == field.types[:1] + field.types[-1:], key  # ARRAY of its item type
                continue
            assert mine.contents() == field.contents(), key
        assert ours.fields["tokenizer.ggml.tokens"].types[-1] == gguf.GGUFValueType.STRING
        assert ours.alignment == theirs.alignment == 64 and ours.data_offset == theirs.data_offset
        assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
        for a, b in zip(ours.tensors, theirs.tensors):
            assert (a.tensor_type, a.data_offset, list(a.shape)) == (b.tensor_type, b.data_offset, list(b.shape))
            assert np.array_equal(np.asarray(a.data), np.asarray(b.data))
    finally:
        release_gguf_readers()


def test_the_full_reader_gives_the_parts_gguf_gives(gguf_path):
    original = gguf.GGUFReader
    with fast_full_reader():
        ours = gguf.GGUFReader(gguf_path)  # as transformers builds it
    assert gguf.GGUFReader is original
    theirs = gguf.GGUFReader(gguf_path)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.data, mine.types, mine.offset) == (field.data, field.types, field.offset), key
        assert len(mine.parts) == len(field.parts) and all(
            np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(mine.parts, field.parts)
        ), key
        assert mine.contents() == field.contents(), key
    assert [(t.name, t.data_offset) for t in ours.tensors] == [(t.name, t.data_offset) for t in theirs.tensors]


def test_equal_rotary_tables_are_computed_once():
    a = RotaryEmbedding(64, 4096, 10000.0, {"rope_type": "linear", "factor": 2.0}, max_model_len=1024)
    b = RotaryEmbedding(64, 4096, 10000.0, {"factor": 2.0, "rope_type": "linear"}, max_model_len=1024)
    c = RotaryEmbedding(64, 4096, 500000.0, {"rope_type": "linear", "factor": 2.0}, max_model_len=1024)
    assert a.cos_sin_cache is b.cos_sin_cache
    assert c.cos_sin_cache is not a.cos_sin_cache and not torch.equal(c.cos_sin_cache, a.cos_sin_cache)
    forget_tables()  # as the loader does once a model is built: the next model's tables are its own
    d = RotaryEmbedding(64, 4096, 10000.0, {"rope_type": "linear", "factor": 2.0}, max_model_len=1024)
    assert d.cos_sin_cache is not a.cos_sin_cache and torch.equal(d.cos_sin_cache, a.cos_sin_cache)
