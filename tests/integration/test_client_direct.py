"""Caller-moved bytes (``batch_put_with`` / ``batch_get_with``) against a real master.

Over shared memory the caller gets the placement's own bytes in the mapped segment (what a
device DMA writes into or reads out of); over forced tcp it gets a host buffer sent after /
read before. A writer and a reader process on 127.0.0.1 move objects byte-exactly both ways;
a failing fill or consume fails its key alone and never leaves a readable object.
"""

from __future__ import annotations

import json
import mmap
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvpool_client.client import KVPoolClient
from kvpool_client.config import ClientConfig
from kvpool_wire.status import Status

SIZES = [1, 4096, 3 << 20, 100_003]


def make_config(master: Any, **changes: Any) -> dict[str, Any]:
    values: dict[str, Any] = {"master_server_address": master.address,
                              "global_segment_size": "64mb", "rpc_timeout_s": 5}
    values.update(changes)
    return values


def expected(index: int) -> bytes:
    return np.random.default_rng(index).integers(0, 256, SIZES[index], dtype=np.uint8).tobytes()


@pytest.fixture(params=["auto", "tcp"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def writer(master: Any, transport: str) -> Iterator[KVPoolClient]:
    with KVPoolClient(ClientConfig.from_dict(make_config(master, transport=transport))) as c:
        yield c


def test_objects_written_by_fill_are_read_by_consume_in_another_process(
        master: Any, writer: KVPoolClient, transport: str) -> None:
    views: list[memoryview] = []

    def fill(index: int, view: memoryview) -> None:
        views.append(view)
        view[:] = expected(index)

    keys = [f"with-{i}" for i in range(len(SIZES))]
    assert writer.batch_put_with(keys, SIZES, fill) == [Status.OK] * len(SIZES)
    # same host: the segment itself; forced tcp: a host buffer that is then sent
    host_buffers = [isinstance(v.obj, bytearray) for v in views]
    assert host_buffers == [transport == "tcp"] * len(SIZES)
    assert writer.get(keys[2]) == expected(2)

    config = json.dumps(make_config(master, transport=transport, global_segment_size=0))
    out = subprocess.run([sys.executable, __file__, config, *keys, "missing"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    report = json.loads(out)
    assert report["results"] == [*SIZES, int(Status.NOT_FOUND)]
    assert report["digests"] == [expected(i).hex()[:64] + str(len(expected(i)))
                                 for i in range(len(SIZES))]
    assert report["segment_memory"] == [transport != "tcp"] * len(SIZES)


def test_checksums_are_taken_from_what_fill_wrote(master: Any, transport: str) -> None:
    config = ClientConfig.from_dict(make_config(master, transport=transport, checksum=True))
    with KVPoolClient(config) as c:
        def fill(index: int, view: memoryview) -> None:
            view[:] = expected(index)

        assert c.batch_put_with(["c0", "c1"], SIZES[:2], fill) == [Status.OK] * 2
        # a read checks the committed checksum against the bytes it moved
        assert c.get_batch(["c0", "c1"]) == [expected(0), expected(1)]
        assert c.batch_get_with(["c1"], lambda i, v: None) == [SIZES[1]]


def test_a_failing_fill_or_consume_fails_its_key_alone(writer: KVPoolClient) -> None:
    def fill(index: int, view: memoryview) -> None:
        if index == 1:
            raise RuntimeError("device copy failed")
        view[:] = expected(index)

    keys = ["f0", "f1", "f2"]
    statuses = writer.batch_put_with(keys, SIZES[:3], fill)
    assert statuses == [Status.OK, Status.TRANSFER_FAILED, Status.OK]
    assert writer.batch_exists(keys) == [True, False, True]  # revoked, never readable
    taken: dict[int, bytes] = {}

    def consume(index: int, view: memoryview) -> None:
        if index == 0:
            raise RuntimeError("device copy failed")
        taken[index] = bytes(view)

    assert writer.batch_get_with(keys, consume) == [int(Status.TRANSFER_FAILED),
                                                   int(Status.NOT_FOUND), SIZES[2]]
    assert taken == {2: expected(2)}


def test_done_runs_once_after_every_fill_or_consume_and_its_failure_fails_them_all(
        writer: KVPoolClient) -> None:
    calls: list[str] = []

    def fill(index: int, view: memoryview) -> None:
        calls.append(f"fill{index}")
        view[:] = expected(index)

    keys = ["d0", "d1", "d2"]
    assert writer.batch_put_with(keys, SIZES[:3], fill, done=lambda: calls.append("done")) \
        == [Status.OK] * 3
    assert sorted(calls[:3]) == ["fill0", "fill1", "fill2"] and calls[3:] == ["done"]

    def failing_done() -> None:
        raise RuntimeError("device stream failed")

    assert writer.batch_put_with(["e0", "e1"], SIZES[:2], fill, done=failing_done) == \
        [Status.TRANSFER_FAILED] * 2
    assert writer.batch_exists(["e0", "e1"]) == [False, False]

    calls.clear()
    taken: dict[int, bytes] = {}

    def consume(index: int, view: memoryview) -> None:
        calls.append(f"consume{index}")
        taken[index] = bytes(view)

    assert writer.batch_get_with(keys, consume, done=lambda: calls.append("done")) == SIZES[:3]
    assert calls[-1] == "done" and len(calls) == 4
    assert taken == {i: expected(i) for i in range(3)}
    assert writer.batch_get_with(keys, consume, done=failing_done) == \
        [int(Status.TRANSFER_FAILED)] * 3


def test_bad_sizes_are_refused_and_a_repeated_key_is_filled_once(
        writer: KVPoolClient) -> None:
    calls: list[int] = []

    def fill(index: int, view: memoryview) -> None:
        calls.append(index)
        view[:] = b"x" * view.nbytes

    statuses = writer.batch_put_with(["b0", "b1", "b2", "b0", "b4", ""],
                                     [8, 0, True, 8, 5, 5], fill)
    # the repeated "b0" (position 3) is written once, by its first position, and reports its
    # status (one duplicate-key policy for every batch call)
    assert statuses == [Status.OK, Status.INVALID_ARGUMENT, Status.INVALID_ARGUMENT,
                        Status.OK, Status.OK, Status.INVALID_KEY]
    assert sorted(calls) == [0, 4]
    assert writer.batch_exists(["b0", "b1", "b2", "b4"]) == [True, False, False, True]
    with pytest.raises(Exception, match="keys but"):
        writer.batch_put_with(["a", "b"], [1], fill)


def test_pinning_covers_every_mapping_and_is_undone_before_unmapping(master: Any) -> None:
    pinned: list[int] = []
    unpinned: list[int] = []
    with KVPoolClient(ClientConfig.from_dict(make_config(master))) as other, \
            KVPoolClient(ClientConfig.from_dict(make_config(master))) as c:
        other.put("theirs", b"t" * 100)  # lands in either segment
        c.put("mine", b"m" * 100)
        c.pin_shared_memory(lambda v: pinned.append(v.nbytes), lambda v: unpinned.append(v.nbytes))
        c.batch_get_with(["theirs", "mine"], lambda i, v: None)
        assert pinned and all(n == 64 << 20 for n in pinned)
        assert unpinned == []
        with pytest.raises(Exception, match="already pinned"):
            c.pin_shared_memory(print, print)
    assert sorted(unpinned) == sorted(pinned)


def reader_main(config_json: str, keys: list[str]) -> None:
    """Read ``keys`` with batch_get_with; print sizes, digests and where the bytes were."""
    digests: dict[int, str] = {}
    segment_memory: dict[int, bool] = {}

    def consume(index: int, view: memoryview) -> None:
        data = bytes(view)
        digests[index] = data.hex()[:64] + str(len(data))
        segment_memory[index] = isinstance(view.obj, mmap.mmap)

    with KVPoolClient(ClientConfig.from_dict(json.loads(config_json))) as c:
        results = c.batch_get_with(keys, consume)
    found = sorted(digests)
    print(json.dumps({"results": results, "digests": [digests[i] for i in found],
                      "segment_memory": [segment_memory[i] for i in found]}))


if __name__ == "__main__":
    reader_main(sys.argv[1], sys.argv[2:])
