"""A shared-memory ring buffer: one writer broadcasts byte messages to a fixed set of readers on one machine.

Contract.
* `ShmRing.create(num_readers, num_slots, slot_bytes)` makes the ring (a file under /dev/shm, or the temporary
  folder where there is none) and is the writer; `ShmRing.attach(handle, reader)` opens it in another process as
  reader number `reader` (0 <= reader < num_readers). `handle()` is what a reader needs (a plain dict: the file's
  path and the sizes), sent to it however the caller likes.
* `write(data)` delivers `data` to every reader, in order: each reader's `read()` returns the writer's messages one
  by one, each exactly once. A message larger than a slot travels in consecutive slots and is reassembled. The
  writer never overwrites a slot that some reader has not read yet: it waits (`timeout` seconds, then
  `TimeoutError`), so a slow reader slows the writer rather than losing messages.
* Waiting never spins for long: a waiter polls for about 50 microseconds, then sleeps in steps growing to
  `max_sleep` (1 ms), and to 20 ms once it has waited a second (an idle engine), so idle readers cost next to no
  CPU (two cores: no thread may steal one from the model); a message is seen within a millisecond while the
  engine is busy, within 20 ms after an idle spell. `read(timeout=None)` waits for ever;
  its `alive` callback, checked every ~0.1 s while waiting, may raise to stop the wait (e.g. when the writer died).
* `close()` unmaps; the writer's also removes the file (readers that attached keep their mapping). Linux and x86
  store order are assumed (a reader that sees a slot's sequence number sees the payload written before it).

Layout: one 64-byte line per reader holding how many messages it has read, then the slots, each a 64-byte header
(sequence number of the message it holds + 1, payload length, "more chunks follow" flag) and `slot_bytes` bytes.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

_LINE = 64
_SPIN_S = 50e-6
_CHECK_EVERY_S = 0.1
_IDLE_AFTER_S = 1.0
_IDLE_SLEEP_S = 0.02


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class ShmRing:
    def __init__(self, path: str, num_readers: int, num_slots: int, slot_bytes: int, reader: int | None) -> None:
        """Use `create` or `attach`."""
        self.path = path
        self.num_readers = num_readers
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.reader = reader  # None: the writer
        size = self._size(num_readers, num_slots, slot_bytes)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if reader is None else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if reader is None:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        buf = memoryview(self._map)
        self._buf = buf
        # Reader r's count of messages read: element r * 8 of this array (one cache line each).
        self._read = np.ndarray((num_readers * _LINE // 8,), dtype=np.uint64, buffer=buf[: num_readers * _LINE])
        stride = _LINE + slot_bytes
        base = num_readers * _LINE
        self._slot_headers = [
            np.ndarray((2,), dtype=np.uint64, buffer=buf[base + i * stride : base + i * stride + 16])
            for i in range(num_slots)
        ]
        self._payloads = [buf[base + i * stride + _LINE : base + (i + 1) * stride] for i in range(num_slots)]
        self._next = 0  # the writer's next message number, or the reader's next to read
        self.max_sleep = 1e-3

    @staticmethod
    def _size(num_readers: int, num_slots: int, slot_bytes: int) -> int:
        return num_readers * _LINE + num_slots * (_LINE + slot_bytes)

    @classmethod
    def create(cls, num_readers: int, num_slots: int = 8, slot_bytes: int = 1 << 20) -> ShmRing:
        """A new ring, this process its writer."""
        if num_readers < 1 or num_slots < 2 or slot_bytes < 64:
            raise ValueError(f"bad ring size: {num_readers} readers, {num_slots} slots of {slot_bytes} bytes")
        path = os.path.join(_shm_dir(), f"pagedllm-ring-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        return cls(path, num_readers, num_slots, slot_bytes, None)

    @classmethod
    def attach(cls, handle: dict[str, Any], reader: int) -> ShmRing:
        """The ring of `handle` (see `handle()`), this process its reader number `reader`."""
        if not 0 <= reader < int(handle["num_readers"]):
            raise ValueError(f"reader {reader} out of range for {handle['num_readers']} readers")
        return cls(
            handle["path"], int(handle["num_readers"]), int(handle["num_slots"]), int(handle["slot_bytes"]), reader
        )

    def handle(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "num_readers": self.num_readers,
            "num_slots": self.num_slots,
            "slot_bytes": self.slot_bytes,
        }

    # ---- waiting ---------------------------------------------------------------------------------------------

    def _wait(self, ready: Callable[[], bool], timeout: float | None, alive: Callable[[], None] | None) -> None:
        if ready():
            return
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        spin_until = start + _SPIN_S
        while time.monotonic() < spin_until:
            if ready():
                return
        sleep = 10e-6
        next_check = start + _CHECK_EVERY_S
        while not ready():
            time.sleep(sleep)
            now = time.monotonic()
            # Busy engines send a step every few ms: 1 ms sleeps at most. After a second with nothing, the engine
            # is idle: longer sleeps, so that idle ranks cost next to no CPU (the first step after costs <= 20 ms).
            sleep = min(sleep * 2, self.max_sleep if now - start < _IDLE_AFTER_S else _IDLE_SLEEP_S)
            if now >= next_check:
                next_check = now + _CHECK_EVERY_S
                if alive is not None:
                    alive()
                if deadline is not None and now >= deadline:
                    raise TimeoutError(f"shared-memory ring {self.path}: no progress in {timeout:.0f} s")

    # ---- writer ----------------------------------------------------------------------------------------------

    def _min_read(self) -> int:
        return int(self._read[:: _LINE // 8].min())

    def write(self, data: bytes, timeout: float | None = 60.0, alive: Callable[[], None] | None = None) -> None:
        """Deliver `data` to every reader (see the module docstring)."""
        assert self.reader is None, "only the writer writes"
        view = memoryview(data)
        total = len(view)
        offset = 0
        while True:
            n = self._next
            # Slot n % S last held message n - S: every reader must have read it.
            oldest = n - self.num_slots + 1
            if oldest > 0:
                self._wait(lambda oldest=oldest: self._min_read() >= oldest, timeout, alive)
            chunk = min(self.slot_bytes, total - offset)
            slot = n % self.num_slots
            self._payloads[slot][:chunk] = view[offset : offset + chunk]
            offset += chunk
            header = self._slot_headers[slot]
            more = offset < total
            header[1] = (chunk << 1) | int(more)
            header[0] = n + 1  # published last: a reader that sees it sees the payload
            self._next = n + 1
            if not more:
                return

    # ---- reader ----------------------------------------------------------------------------------------------

    def read(self, timeout: float | None = None, alive: Callable[[], None] | None = None) -> bytes:
        """The next message (see the module docstring)."""
        assert self.reader is not None, "the writer does not read"
        parts: list[bytes] = []
        while True:
            n = self._next
            slot = n % self.num_slots
            header = self._slot_headers[slot]
            self._wait(lambda header=header, n=n: int(header[0]) == n + 1, timeout, alive)
            info = int(header[1])
            chunk, more = info >> 1, info & 1
            parts.append(bytes(self._payloads[slot][:chunk]))
            self._next = n + 1
            self._read[self.reader * _LINE // 8] = n + 1
            if not more:
                return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        """Unmap; the writer also removes the file."""
        if self._map.closed:
            return
        self._read = self._slot_headers = self._payloads = None  # type: ignore[assignment]
        try:
            self._buf.release()
            self._map.close()
        except BufferError:  # a view still referenced elsewhere: the mapping goes with it
            pass
        if self.reader is None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
