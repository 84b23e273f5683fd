"""The shared-memory broadcast ring (distributed/shm_ring.py): every reader gets every message once, in order,
across processes, with messages larger than a slot and many wrap-arounds; a writer facing a reader that does not
read times out instead of overwriting; a waiting reader stops when its `alive` callback raises; the writer's
close removes the file."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from pagedllm.distributed.shm_ring import ShmRing

READER = r"""
import hashlib, json, sys
from pagedllm.distributed.shm_ring import ShmRing
ring = ShmRing.attach(json.loads(sys.argv[1]), int(sys.argv[2]))
digest, count = hashlib.sha256(), 0
while True:
    message = ring.read()
    if message == b"stop":
        break
    digest.update(len(message).to_bytes(8, "little") + message)
    count += 1
ring.close()
print(count, digest.hexdigest())
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("readers", [1, 3])
def test_every_reader_gets_every_message_in_order(readers: int) -> None:
    ring = ShmRing.create(readers, num_slots=4, slot_bytes=256)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", READER, json.dumps(ring.handle()), str(r)], stdout=subprocess.PIPE, text=True
        )
        for r in range(readers)
    ]
    try:
        digest = hashlib.sha256()
        sizes = [0, 1, 255, 256, 257, 1000, 4 * 256, 4 * 256 + 1, 5000]  # empty, a slot, several, > the ring
        for i in range(2000):
            message = os.urandom(sizes[i % len(sizes)])
            ring.write(message, timeout=60)
            digest.update(len(message).to_bytes(8, "little") + message)
        ring.write(b"stop", timeout=60)
        results = [p.communicate(timeout=60)[0].split() for p in procs]
        assert results == [["2000", digest.hexdigest()]] * readers
    finally:
        for p in procs:
            p.kill()
            p.wait()
        ring.close()
    assert not os.path.exists(ring.path)


def test_the_writer_waits_for_slow_readers_then_times_out() -> None:
    ring = ShmRing.create(1, num_slots=2, slot_bytes=64)
    reader = ShmRing.attach(ring.handle(), 0)
    try:
        ring.write(b"a", timeout=1)
        ring.write(b"b", timeout=1)
        with pytest.raises(TimeoutError):
            ring.write(b"c", timeout=0.3)  # both slots hold unread messages
        assert reader.read() == b"a"
        ring.write(b"c", timeout=1)  # a slot was freed
        assert (reader.read(), reader.read()) == (b"b", b"c")
    finally:
        reader.close()
        ring.close()


def test_a_waiting_reader_stops_when_alive_raises() -> None:
    ring = ShmRing.create(1)
    reader = ShmRing.attach(ring.handle(), 0)
    calls = []

    def alive() -> None:
        calls.append(1)
        if len(calls) >= 2:
            raise RuntimeError("writer gone")

    try:
        with pytest.raises(RuntimeError, match="writer gone"):
            reader.read(alive=alive)
        with pytest.raises(ValueError, match="reader 1 out of range"):
            ShmRing.attach(ring.handle(), 1)
    finally:
        reader.close()
        ring.close()
