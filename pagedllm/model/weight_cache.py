"""GGUF weight cache: the de-quantized tensors of a GGUF file, saved once, memory-mapped on later loads.

Contract.
* `gguf_weights(path, convert)` yields the same (HF name, float32 tensor) pairs as `convert()` (the loader's
  de-quantization and un-permutation of the GGUF file at `path`): from the cache file when a valid one exists,
  else from `convert()`, writing the cache file while the pairs pass through (no second copy of the weights in
  memory). Cached tensors are copy-on-write maps of the file: nothing is read until the model copies them.
* Where: ``config.cache_dir()/weights/<key>.safetensors``, a standard safetensors file (F32, HF names) whose
  ``__metadata__`` repeats the key. The key is a SHA-256 over `CACHE_FORMAT`, pagedllm's version, the `gguf`
  package's version (its de-quantization) and the SHA-256 of the GGUF file's whole content, so a copy of the
  same file elsewhere (or reinstalled with a new mtime) hits, and any changed byte misses. Hashing the content
  reads the whole file (~0.1 s for the default 98 MB model, seconds for a multi-GB one), so the digest is
  memoized under ``weights/stamps/`` per (absolute path, size, mtime_ns, inode): a warm start only stats the file.
* Writes are atomic: the file is written under a temporary name in the same folder (``<key>.<pid>.tmp``) and
  renamed into place, so a reader never sees a partial file and two processes converting at once both leave a
  complete one (the last rename wins). Temporary files of dead processes are removed on the next write.
* A cache file is used only if it validates: a parseable header, the expected format and key, F32 tensors whose
  offsets tile the data exactly, and a file length equal to header plus data. Anything else (truncated, garbage,
  another key) is logged, ignored and replaced by a fresh conversion. Tensor bytes are not checksummed: hashing
  4 bytes per parameter would cost most of what the cache saves, and the file is only ever renamed into place
  complete.
* Failing to write (read-only or full disk) only logs a warning: the load goes on from the GGUF.
* Bounded: the files together stay within ``$PAGEDLLM_WEIGHT_CACHE_GB`` (GiB, default 16; 0 turns the cache off).
  A hit marks its file used (its access time); after a write, the least recently used other files are deleted
  until the total fits. A write stops (and leaves nothing) when the disk's free space would drop below
  `MIN_FREE_BYTES` or 5% of the disk, whichever is larger: the cache never fills a disk.
The cache holds 4 bytes per parameter (540 MB for the default model). ``rm -r <cache_dir>/weights`` empties it.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.metadata
import json
import logging
import os
import struct
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

from pagedllm.config import cache_dir, weight_cache_gb

logger = logging.getLogger(__name__)

CACHE_FORMAT = "pagedllm-gguf-f32-1"  # bump when the conversion (names, un-permutation) changes
# Room for the 8-byte length and the JSON header written before the data (~150 bytes a tensor): 1 MiB holds
# thousands of tensors, and keeps the data page-aligned. A larger header is written by copying the data once.
_HEADER_ROOM = 1 << 20
_MAX_HEADER = 100 << 20
DEFAULT_MAX_GB = 16.0
MIN_FREE_BYTES = 2 << 30
WeightIterator = Iterator[tuple[str, torch.Tensor]]


def gguf_weights(path: str, convert: Callable[[], Iterable[tuple[str, torch.Tensor]]]) -> WeightIterator:
    """(name, tensor) pairs of the GGUF file at `path`: from its cache file, or from `convert()` while the
    cache file is written."""
    if max_bytes() <= 0:
        yield from convert()
        return
    try:
        key = cache_key(path)
    except OSError as e:
        logger.warning("weight cache: off (%s)", e)
        yield from convert()
        return
    file = os.path.join(weights_dir(), f"{key}.safetensors")
    tensors = open_cached(file, key)
    if tensors is not None:
        logger.info("weight cache: hit %s", file)
        _mark_used(file)
        yield from tensors
        return
    logger.info("weight cache: miss, de-quantizing %s into %s", os.path.basename(path), file)
    yield from _convert_and_write(convert(), file, {"format": CACHE_FORMAT, "key": key, "source": path})


def weights_dir() -> str:
    return os.path.join(cache_dir(), "weights")


def max_bytes() -> int:
    """The bound on the cache files' total size: $PAGEDLLM_WEIGHT_CACHE_GB GiB (default 16; 0 = no cache)."""
    return max(0, int(weight_cache_gb(DEFAULT_MAX_GB) * (1 << 30)))


def _mark_used(file: str) -> None:
    """Record a use of `file` in its access time (the eviction order), whatever the mount's atime policy."""
    with contextlib.suppress(OSError):
        os.utime(file, (time.time(), os.stat(file).st_mtime))


def prune(keep: str | None = None, limit: int | None = None) -> list[str]:
    """Delete the least recently used cache files (never `keep`) until the rest fit in `limit` bytes (default
    `max_bytes()`); the deleted paths."""
    limit = max_bytes() if limit is None else limit
    files = []
    for f in glob.glob(os.path.join(glob.escape(weights_dir()), "*.safetensors")):
        with contextlib.suppress(OSError):
            st = os.stat(f)
            files.append((max(st.st_atime, st.st_mtime), st.st_size, f))
    total = sum(size for _, size, _ in files)
    removed = []
    for _, size, f in sorted(files):
        if total <= limit:
            break
        if keep is not None and os.path.abspath(f) == os.path.abspath(keep):
            continue
        try:
            os.unlink(f)
        except OSError as e:
            logger.warning("weight cache: could not remove %s (%s)", f, e)
            continue
        total -= size
        removed.append(f)
        logger.info("weight cache: removed the least recently used %s (%.2f GiB)", f, size / (1 << 30))
    return removed


def cache_key(path: str) -> str:
    """The cache key of the GGUF file at `path` (see the module docstring)."""
    version = importlib.metadata.version
    versions = f"{CACHE_FORMAT}|{version('pagedllm')}|{version('gguf')}"
    return hashlib.sha256(f"{versions}|{content_digest(path)}".encode()).hexdigest()[:40]


def content_digest(path: str) -> str:
    """SHA-256 of the file's content, memoized per (absolute path, size, mtime_ns, inode)."""
    st = os.stat(path)
    ident = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    stamp = os.path.join(weights_dir(), "stamps", hashlib.sha256(ident.encode()).hexdigest()[:40])
    with contextlib.suppress(OSError, UnicodeDecodeError):
        with open(stamp, encoding="ascii") as f:
            digest = f.read().strip()
        if len(digest) == 64:
            return digest
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    try:
        os.makedirs(os.path.dirname(stamp), exist_ok=True)
        _atomic_write(stamp, digest.encode())
    except OSError as e:  # only costs the hashing next time
        logger.warning("weight cache: could not save the digest stamp %s: %s", stamp, e)
    return digest


# ---- reading --------------------------------------------------------------------------------------------------


def open_cached(file: str, key: str) -> list[tuple[str, torch.Tensor]] | None:
    """The tensors of a valid cache file, mapped copy-on-write; None when it is missing or invalid (logged)."""
    try:
        return _read(file, key)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except Exception as e:  # malformed in any way (bad JSON, wrong types, short file): never fatal
        logger.warning("weight cache: ignoring invalid cache file %s (%s); converting the GGUF again", file, e)
        return None


def _read(file: str, key: str) -> list[tuple[str, torch.Tensor]]:
    # One open file for the checks and the map: a concurrent writer's rename cannot swap the file in between.
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than its header length")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER):
            raise ValueError(f"header length {n} beyond the file's {size} bytes")
        header = json.loads(f.read(n))
        _check(header, key, size - 8 - n)
        data = np.memmap(f, dtype=np.uint8, mode="c", offset=8 + n)
    out = []
    for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, stop = e["data_offsets"]
        arr = data[begin:stop].view(np.float32).reshape(e["shape"])
        out.append((name, torch.from_numpy(arr)))
    return out


def _check(header: object, key: str, data_len: int) -> None:
    """Pop the __metadata__ of `header`; ValueError naming what is wrong unless the rest describes a cache file of
    `key` whose tensors tile `data_len` bytes of data."""
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if meta.get("format") != CACHE_FORMAT or meta.get("key") != key:
        raise ValueError(f"format/key {meta.get('format')!r}/{meta.get('key')!r} do not match")
    entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    end = 0
    for name, e in entries:
        begin, stop = e["data_offsets"]
        shape = [int(d) for d in e["shape"]]
        if e["dtype"] != "F32" or begin != end or stop - begin != 4 * int(np.prod(shape, dtype=np.int64)):
            raise ValueError(f"tensor {name!r} has a bad dtype, shape or offsets")
        end = stop
    if end != data_len:
        raise ValueError(f"{data_len} bytes of data where the header describes {end}")
    if not entries:
        raise ValueError("no tensors")


# ---- writing --------------------------------------------------------------------------------------------------


def _convert_and_write(pairs: Iterable[tuple[str, torch.Tensor]], file: str, meta: dict[str, str]) -> WeightIterator:
    writer = _Writer.create(file)
    try:
        for name, tensor in pairs:
            if writer is not None:
                try:
                    writer.add(name, tensor)
                except OSError as e:
                    logger.warning("weight cache: not written (%s)", e)
                    writer.abort()
                    writer = None
            yield name, tensor
        if writer is not None:
            try:
                writer.finish(meta)
                logger.info("weight cache: written %s", file)
                prune(keep=file)
            except OSError as e:
                logger.warning("weight cache: not written (%s)", e)
            writer = None
    finally:
        if writer is not None:  # the consumer stopped early or raised: leave no temporary file behind
            writer.abort()


class _Writer:
    """A safetensors file written in one pass: data after a reserved header room, the header last."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.tmp = f"{file[: -len('.safetensors')]}.{os.getpid()}.tmp"
        disk = os.statvfs(os.path.dirname(file))
        self.reserve = max(MIN_FREE_BYTES, disk.f_blocks * disk.f_frsize // 20)
        self.limit = max_bytes()
        self.entries: dict[str, dict] = {}
        self.offset = 0
        self.f = open(self.tmp, "wb")  # noqa: SIM115 (closed in finish/abort)
        self.f.seek(_HEADER_ROOM)

    @classmethod
    def create(cls, file: str) -> _Writer | None:
        try:
            os.makedirs(os.path.dirname(file), exist_ok=True)
            _remove_dead_temporaries(file)
            return cls(file)
        except OSError as e:
            logger.warning("weight cache: not written (%s)", e)
            return None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        arr = np.ascontiguousarray(tensor.detach().cpu().numpy(), dtype=np.float32)
        if self.offset + arr.nbytes > self.limit:
            raise OSError(f"the weights exceed the cache's bound of {self.limit / (1 << 30):.1f} GiB")
        disk = os.statvfs(os.path.dirname(self.file))
        if disk.f_bavail * disk.f_frsize - arr.nbytes < self.reserve:
            raise OSError(f"the disk would keep less than {self.reserve / (1 << 30):.1f} GiB free")
        self.f.write(arr.data)
        end = self.offset + arr.nbytes
        self.entries[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [self.offset, end]}
        self.offset = end

    def finish(self, meta: dict[str, str]) -> None:
        header = json.dumps({"__metadata__": meta, **self.entries}, separators=(",", ":")).encode()
        room = _HEADER_ROOM - 8
        if len(header) <= room:
            # The safetensors format allows the header to be padded with spaces.
            self.f.seek(0)
            self.f.write(struct.pack("<Q", room) + header + b" " * (room - len(header)))
            self.f.close()
        else:
            self._rewrite_with(header)
        os.replace(self.tmp, self.file)

    def _rewrite_with(self, header: bytes) -> None:
        header += b" " * (-(8 + len(header)) % 64)
        self.f.close()
        other = self.tmp + "2"
        with open(self.tmp, "rb") as src, open(other, "wb") as dst:
            dst.write(struct.pack("<Q", len(header)) + header)
            src.seek(_HEADER_ROOM)
            while chunk := src.read(64 << 20):
                dst.write(chunk)
        os.replace(other, self.tmp)

    def abort(self) -> None:
        self.f.close()
        with contextlib.suppress(OSError):
            os.unlink(self.tmp)


def _remove_dead_temporaries(file: str) -> None:
    """Delete `<key>.<pid>.tmp` files of `file` left by processes that no longer exist (killed mid-write)."""
    for tmp in glob.glob(f"{glob.escape(file[: -len('.safetensors')])}.*.tmp"):
        pid = tmp.rsplit(".", 2)[-2]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        except PermissionError:  # alive, someone else's
            pass


def _atomic_write(path: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
