"""The GGUF weight cache: a miss converts and writes, a hit maps the file and converts nothing, the file is a
standard safetensors file, the key follows the content, and a partial, corrupt or foreign cache file (or an
unwritable cache folder, or a consumer that stops early) falls back to the GGUF and leaves no debris."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pagedllm.model import weight_cache
from pagedllm.model.loader import iterate_gguf


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(folder))
    return folder


def _tensors(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(32, 8, generator=g)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 8, generator=g)),
        ("model.norm.weight", torch.randn(8, generator=g)),
    ]


class Converter:
    """A stand-in for the de-quantization: counts its calls and yields fresh copies of fixed tensors."""

    def __init__(self, seed: int = 0) -> None:
        self.tensors = _tensors(seed)
        self.calls = 0

    def __call__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.calls += 1
        for name, t in self.tensors:
            yield name, t.clone()


@pytest.fixture
def gguf_path(tmp_path: Path) -> str:
    path = tmp_path / "model.gguf"  # only its bytes matter to the cache
    path.write_bytes(os.urandom(4096))
    return str(path)


def _load(path: str, convert: Converter) -> dict[str, torch.Tensor]:
    return dict(weight_cache.gguf_weights(path, convert))


def _assert_same(got: dict[str, torch.Tensor], convert: Converter) -> None:
    assert list(got) == [name for name, _ in convert.tensors]
    for name, t in convert.tensors:
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name], t, rtol=0, atol=0)


def _cache_files(cache_dir: Path) -> list[Path]:
    return sorted(p for p in (cache_dir / "weights").iterdir() if p.is_file())


def test_miss_writes_then_hit_maps_without_converting(gguf_path: str, cache_dir: Path) -> None:
    convert = Converter()
    _assert_same(_load(gguf_path, convert), convert)
    assert convert.calls == 1
    (file,) = _cache_files(cache_dir)
    assert file.suffix == ".safetensors"

    got = _load(gguf_path, convert)
    assert convert.calls == 1  # the hit converted nothing
    _assert_same(got, convert)
    got["model.norm.weight"].add_(1.0)  # copy-on-write: the cache file is untouched
    _assert_same(_load(gguf_path, convert), convert)
    assert convert.calls == 1


def test_cache_file_is_standard_safetensors(gguf_path: str, cache_dir: Path) -> None:
    from safetensors import safe_open

    convert = Converter()
    _load(gguf_path, convert)
    (file,) = _cache_files(cache_dir)
    with safe_open(str(file), framework="pt") as f:
        assert f.metadata()["format"] == weight_cache.CACHE_FORMAT
        assert f.metadata()["key"] == weight_cache.cache_key(gguf_path)
        _assert_same({name: f.get_tensor(name) for name in f.keys()}, convert)  # noqa: SIM118


def test_key_follows_content_not_path(gguf_path: str, tmp_path: Path) -> None:
    copy = tmp_path / "elsewhere" / "copy.gguf"
    copy.parent.mkdir()
    copy.write_bytes(Path(gguf_path).read_bytes())
    assert weight_cache.cache_key(str(copy)) == weight_cache.cache_key(gguf_path)
    convert = Converter()
    _load(gguf_path, convert)
    _load(str(copy), convert)
    assert convert.calls == 1

    data = bytearray(Path(gguf_path).read_bytes())
    data[2000] ^= 1  # one changed byte, same size
    Path(gguf_path).write_bytes(bytes(data))
    assert weight_cache.cache_key(gguf_path) != weight_cache.cache_key(str(copy))
    _load(gguf_path, convert)
    assert convert.calls == 2


def _truncate(data: bytes) -> bytes:
    return data[: len(data) - 100]


def _garbage_header(data: bytes) -> bytes:
    return data[:8] + b"\x00garbage" + data[17:]


def _huge_header_length(data: bytes) -> bytes:
    return struct.pack("<Q", 1 << 62) + data[8:]


def _trailing_bytes(data: bytes) -> bytes:
    return data + b"\x00" * 64


def _other_key(data: bytes) -> bytes:
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"]["key"] = "0" * 40
    raw = json.dumps(header).encode()
    return struct.pack("<Q", n) + raw + b" " * (n - len(raw)) + data[8 + n :]


def _metadata_not_an_object(data: bytes) -> bytes:
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"] = [1, 2]
    raw = json.dumps(header).encode()
    return struct.pack("<Q", n) + raw + b" " * (n - len(raw)) + data[8 + n :]


def _bad_offsets(data: bytes) -> bytes:
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["model.norm.weight"]["data_offsets"][1] += 4
    raw = json.dumps(header).encode()
    return struct.pack("<Q", n) + raw + b" " * (n - len(raw)) + data[8 + n :]


@pytest.mark.parametrize(
    "damage",
    [_truncate, _garbage_header, _huge_header_length, _trailing_bytes, _other_key, _metadata_not_an_object]
    + [_bad_offsets, lambda d: b""],
    ids=["truncated", "garbage-header", "huge-header-length", "trailing-bytes", "other-key", "metadata-list"]
    + ["bad-offsets", "empty"],
)
def test_damaged_cache_file_falls_back_to_the_gguf_and_is_rewritten(gguf_path: str, cache_dir: Path, damage) -> None:
    convert = Converter()
    _load(gguf_path, convert)
    (file,) = _cache_files(cache_dir)
    file.write_bytes(damage(file.read_bytes()))

    _assert_same(_load(gguf_path, convert), convert)
    assert convert.calls == 2  # converted again
    _assert_same(_load(gguf_path, convert), convert)
    assert convert.calls == 2  # and the rewritten file hits
    assert _cache_files(cache_dir) == [file]  # no temporary file left


def test_consumer_stopping_early_leaves_no_file(gguf_path: str, cache_dir: Path) -> None:
    it = weight_cache.gguf_weights(gguf_path, Converter())
    next(it)
    it.close()
    assert _cache_files(cache_dir) == []


def test_two_writers_at_once_leave_one_complete_file(
    gguf_path: str, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two processes converting together: two interleaved loads whose writers carry two live pids (ours, our parent's).
    pid = [os.getpid()]
    real_getpid = os.getpid
    monkeypatch.setattr(weight_cache.os, "getpid", lambda: pid[0])
    a = weight_cache.gguf_weights(gguf_path, Converter())
    next(a)  # a missed and is writing
    pid[0] = os.getppid()
    b_convert = Converter()
    _assert_same(_load(gguf_path, b_convert), b_convert)  # b missed too, wrote and renamed its file
    pid[0] = real_getpid()
    list(a)  # a finishes and renames over b's
    convert = Converter()
    _assert_same(_load(gguf_path, convert), convert)
    assert convert.calls == 0  # the file in place is complete
    assert len(_cache_files(cache_dir)) == 1  # and no temporary is left


def _target(gguf_path: str) -> Path:
    return Path(weight_cache.weights_dir()) / weight_cache.cache_key(gguf_path)


def test_temporaries_of_dead_processes_are_removed(gguf_path: str, cache_dir: Path) -> None:
    weight_cache.cache_key(gguf_path)  # creates the folder
    dead = Path(f"{_target(gguf_path)}.999999999.tmp")  # beyond pid_max: no such process
    dead.write_bytes(b"partial")
    convert = Converter()
    _load(gguf_path, convert)
    assert not dead.exists()
    assert len(_cache_files(cache_dir)) == 1


def test_unwritable_cache_folder_still_loads(
    gguf_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(blocker / "cache"))
    convert = Converter()
    with caplog.at_level("WARNING", logger="pagedllm"):
        _assert_same(_load(gguf_path, convert), convert)
        _assert_same(_load(gguf_path, convert), convert)
    assert convert.calls == 2
    assert "not written" in caplog.text


def _other_gguf(tmp_path: Path, n: int) -> str:
    path = tmp_path / f"model{n}.gguf"
    path.write_bytes(os.urandom(4096))
    return str(path)


def test_the_cache_stays_within_its_bound_evicting_the_least_recently_used(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    one_file = sum(t.numel() * 4 for _, t in _tensors()) + (1 << 20)  # data after the 1 MiB header room
    monkeypatch.setenv("PAGEDLLM_WEIGHT_CACHE_GB", str(2.5 * one_file / (1 << 30)))  # room for two files
    a, b, c = (_other_gguf(tmp_path, n) for n in range(3))
    _load(a, Converter())
    _load(b, Converter())
    assert len(_cache_files(cache_dir)) == 2
    past = os.stat(_target(a).with_suffix(".safetensors")).st_mtime - 100
    for path in (a, b):  # both written long ago; then `a` is used again, so `b` is the least recently used
        os.utime(_target(path).with_suffix(".safetensors"), (past, past))
    convert = Converter()
    _assert_same(_load(a, convert), convert)
    assert convert.calls == 0
    _load(c, Converter())
    kept = {p.name for p in _cache_files(cache_dir)}
    assert kept == {_target(a).name + ".safetensors", _target(c).name + ".safetensors"}
    assert sum(p.stat().st_size for p in _cache_files(cache_dir)) <= 2.5 * one_file


def test_a_file_larger_than_the_bound_is_not_written(
    gguf_path: str, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PAGEDLLM_WEIGHT_CACHE_GB", str(100 / (1 << 30)))  # 100 bytes
    convert = Converter()
    with caplog.at_level("WARNING", logger="pagedllm"):
        _assert_same(_load(gguf_path, convert), convert)
    assert "exceed the cache's bound" in caplog.text
    assert _cache_files(cache_dir) == []


def test_zero_turns_the_cache_off_and_a_bad_value_is_named(
    gguf_path: str, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDLLM_WEIGHT_CACHE_GB", "0")
    convert = Converter()
    _assert_same(_load(gguf_path, convert), convert)
    _assert_same(_load(gguf_path, convert), convert)
    assert convert.calls == 2
    assert not cache_dir.exists() or _cache_files(cache_dir) == []
    monkeypatch.setenv("PAGEDLLM_WEIGHT_CACHE_GB", "lots")
    with pytest.raises(ValueError, match="PAGEDLLM_WEIGHT_CACHE_GB='lots'"):
        _load(gguf_path, convert)


def test_a_nearly_full_disk_is_left_alone(
    gguf_path: str, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = os.statvfs

    def nearly_full(path: str) -> os.statvfs_result:
        st = real(path)
        fields = list(st)
        fields[4] = fields[3] = (1 << 30) // st.f_frsize  # f_bfree = f_bavail = 1 GiB of a large disk
        return os.statvfs_result(fields)

    monkeypatch.setattr(weight_cache.os, "statvfs", nearly_full)
    convert = Converter()
    with caplog.at_level("WARNING", logger="pagedllm"):
        _assert_same(_load(gguf_path, convert), convert)
    assert "less than" in caplog.text and "free" in caplog.text
    assert _cache_files(cache_dir) == []


def _write_tiny_gguf(path: Path) -> None:
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_tensor("token_embd.weight", rng.standard_normal((16, 32), dtype=np.float32))
    q8 = gguf.quants.quantize(rng.standard_normal((8, 32), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_k.weight", rng.standard_normal((4, 32), dtype=np.float32))
    w.add_tensor("output_norm.weight", rng.standard_normal(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_real_gguf_through_the_cache_equals_the_conversion(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path)
    cfg = SimpleNamespace(num_attention_heads=2, num_key_value_heads=1)
    expected = dict(iterate_gguf(str(path), cfg))
    assert "model.layers.0.self_attn.q_proj.weight" in expected
    for _ in range(2):  # the miss, then the hit
        got = dict(weight_cache.gguf_weights(str(path), lambda: iterate_gguf(str(path), cfg)))
        assert list(got) == list(expected)
        for name, t in expected.items():
            torch.testing.assert_close(got[name], t, rtol=0, atol=0)
