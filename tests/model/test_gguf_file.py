"""open_gguf: the faster reader (over a plain ndarray view of the mapping) reads exactly what gguf's own reader
reads: every metadata field, including string arrays, and every tensor's name, type, shape and bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pagedllm.model.gguf_file import open_gguf


def _write(path: Path) -> None:
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_head_count(2)
    w.add_token_list([f"tok{i}" for i in range(300)] + ["é", ""])
    w.add_token_scores([float(i) for i in range(302)])
    w.add_string("general.name", "tiny")
    w.add_tensor("token_embd.weight", rng.standard_normal((16, 32), dtype=np.float32))
    q8 = gguf.quants.quantize(rng.standard_normal((8, 32), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_open_gguf_reads_what_gguf_reads(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "tiny.gguf"
    _write(path)
    ours, theirs = open_gguf(str(path)), gguf.GGUFReader(str(path))
    assert open_gguf(str(path)) is ours  # parsed once per process
    assert not isinstance(ours.data, np.memmap)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert ours.fields[key].contents() == field.contents(), key
    assert ours.fields["tokenizer.ggml.tokens"].contents()[-2:] == ["é", ""]
    assert len(ours.tensors) == len(theirs.tensors) == 2
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, list(a.shape)) == (b.name, b.tensor_type, list(b.shape))
        np.testing.assert_array_equal(a.data, b.data)
