"""Keys, buffers, regions, checksums and client metrics (no sockets, no master)."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from prometheus_client import generate_latest

from kvpool_client.buffers import (
    BufferRegistry,
    address_of,
    alloc_bytes,
    byte_view,
    regions_of,
    slice_view,
    to_key,
)
from kvpool_client.core.regions import checksum, trim_regions
from kvpool_client.drivers.aio import PIPELINE_MIN_BYTES, pipeline_spans
from kvpool_client.metrics import ClientMetrics, Histogram
from kvpool_client.segments import split_sizes
from kvpool_wire.status import KVPoolError, Status


def test_keys() -> None:
    assert to_key("blk-1") == b"blk-1"
    assert to_key("é") == "é".encode()
    assert to_key(bytearray(b"\x00\x01")) == b"\x00\x01"
    for bad in ("", b"", "k" * 1025, 3, None):
        with pytest.raises(KVPoolError) as info:
            to_key(bad)  # type: ignore[arg-type]
        assert info.value.status == Status.INVALID_KEY
    assert to_key("k" * 1024) == b"k" * 1024


def test_byte_views() -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    view = byte_view(array)
    assert view.format == "B" and view.nbytes == 48
    with pytest.raises(KVPoolError, match="not contiguous"):
        byte_view(array[:, ::2])
    with pytest.raises(KVPoolError, match="read-only"):
        byte_view(b"abc", writable=True)
    with pytest.raises(KVPoolError, match="does not expose a buffer"):
        byte_view(object())
    with pytest.raises(KVPoolError, match="list of buffers"):
        regions_of(b"abc")


def test_slices_and_trimming() -> None:
    view = byte_view(bytearray(range(10)))
    assert bytes(slice_view(view, 2, 3)) == b"\x02\x03\x04"
    for offset, size in ((-1, 2), (8, 3), (0, -1), (True, 1)):
        with pytest.raises(KVPoolError) as info:
            slice_view(view, offset, size)
        assert info.value.status == Status.INVALID_ARGUMENT
    regions = [byte_view(bytearray(b"abc")), byte_view(bytearray(b"")),
               byte_view(bytearray(b"defg"))]
    assert [bytes(r) for r in trim_regions(regions, 5)] == [b"abc", b"de"]
    assert [bytes(r) for r in trim_regions(regions, 7)] == [b"abc", b"defg"]


def test_checksum_is_xxh3_of_the_concatenation() -> None:
    data = np.random.default_rng(3).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    split = [memoryview(data)[:1], memoryview(data)[1:5000], memoryview(data)[5000:]]
    assert checksum(split) == checksum([memoryview(data)]) == xxhash.xxh3_64_intdigest(data)


def test_alloc_bytes_is_filled_in_place() -> None:
    obj, view = alloc_bytes(1 << 16)
    view[:] = b"\xab" * (1 << 16)
    assert obj == b"\xab" * (1 << 16) and type(obj) is bytes
    assert hash(obj) == hash(b"\xab" * (1 << 16))


def test_buffer_registry() -> None:
    registry = BufferRegistry()
    array = np.zeros(1000, dtype=np.uint8)
    view = registry.register(array)
    assert registry.view(array) is view and len(registry) == 1
    base = address_of(view)
    inner = registry.find(base + 100, 50)
    assert inner is not None and inner.nbytes == 50
    inner[:] = b"\x07" * 50
    assert array[100:150].tolist() == [7] * 50
    assert registry.find(base + 990, 20) is None
    registry.unregister(array)
    with pytest.raises(KVPoolError):
        registry.unregister(array)
    assert address_of(byte_view(b"readonly")) != 0


def test_segment_split() -> None:
    assert split_sizes(0, 0) == []
    assert split_sizes(10, 0) == [10]
    assert split_sizes(10, 4) == [4, 4, 2]
    assert split_sizes(8, 4) == [4, 4]


def test_pipeline_spans() -> None:
    small = [4096] * 32
    assert pipeline_spans(small) == [(0, 32)]
    big = [1 << 20] * 32  # 32 MiB
    spans = pipeline_spans(big)
    assert spans == [(0, 16), (16, 32)]
    assert pipeline_spans([PIPELINE_MIN_BYTES * 4]) == [(0, 1)]  # one key is never cut
    uneven = [20 << 20, 1, 1, 20 << 20]
    spans = pipeline_spans(uneven)
    assert spans[0][0] == 0 and spans[-1][1] == 4
    assert all(a < b for a, b in spans) and all(spans[i][1] == spans[i + 1][0]
                                                for i in range(len(spans) - 1))


def test_metrics_exposition() -> None:
    metrics = ClientMetrics()
    metrics.observe_transfer("shm", "write", 4096, 30e-6)
    metrics.observe_transfer("shm", "write", 4096, 3.0)
    metrics.observe_op("put", 150e-6)
    metrics.count_failures("get", [int(Status.NOT_FOUND), 0, int(Status.NOT_FOUND)])
    metrics.count_lookups(3, 1)
    metrics.watch_refusals(lambda: {"refused": 2})
    text = generate_latest(metrics.registry).decode()
    assert 'kvpool_client_transfer_bytes_total{op="write",transport="shm"} 8192.0' in text
    assert 'kvpool_client_transfer_seconds_bucket{le="5e-05",op="write",transport="shm"} 1.0' \
        in text
    assert 'kvpool_client_transfer_seconds_count{op="write",transport="shm"} 2.0' in text
    assert 'kvpool_client_op_failures_total{op="get",status="NOT_FOUND"} 2.0' in text
    assert "kvpool_client_lookup_hits_total 1.0" in text
    assert 'kvpool_client_data_server_refusals_total{reason="refused"} 2.0' in text


def test_histogram_buckets_are_le() -> None:
    histogram = Histogram((1.0, 2.0))
    for value in (0.5, 1.0, 1.5, 2.0, 9.0):
        histogram.observe(value)
    assert histogram.cumulative() == [("1.0", 2), ("2.0", 4), ("+Inf", 5)]
    assert histogram.count == 5 and histogram.sum == 14.0
