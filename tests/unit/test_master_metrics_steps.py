"""/metrics, /status and GetStats of a master that knows many segments: made in bounded
steps, the event loop serving other work between them, and the same text as made at once."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from kvpool_master.clock import ServingClock
from kvpool_master.core.master import CoreConfig, MasterCore
from kvpool_master.metrics import (
    SEGMENT_GAUGES,
    SEGMENT_STEP_ROWS,
    HttpEndpoint,
    MasterMetrics,
    segment_row,
    status_from_stats,
)
from kvpool_master.rpc.servicer import Servicer, Stepped
from kvpool_wire import calls
from kvpool_wire.status import Status
from kvpool_wire.types import ClientId, PutOptions, SegmentId, SegmentInfo

#: a segment id with every character the text format escapes in a label value
ODD_ID = 'odd "seg" \\ with\na newline'


def _core(num_segments: int) -> MasterCore:
    """A core with ``num_segments`` segments (of clients of up to 1,000 each), the first named
    ``ODD_ID``, and some objects in them."""
    core = MasterCore(CoreConfig())
    for i in range(num_segments):
        client = ClientId(f"c{i // 1000}")
        if i % 1000 == 0:
            core.register_client(client, "h", b"k" * 32, 0.0)
        segment_id = SegmentId(ODD_ID if i == 0 else f"s{i}")
        assert core.mount_segment(SegmentInfo(segment_id, client, (1 << 20) + 4096 * i),
                                  0.0) == Status.OK
    keys = [b"k%d" % i for i in range(50)]
    core.put_start(ClientId("c0"), keys, [5000] * len(keys), PutOptions(), 1.0)
    core.put_end(ClientId("c0"), keys, 1.0)
    return core


def test_the_segment_gauges_read_as_the_library_would_render_them() -> None:
    core = _core(300)
    pieces = list(MasterMetrics(core, ServingClock(), master_id="m").exposition_steps())
    # the registry, one piece per SEGMENT_STEP_ROWS segments, then one per gauge
    assert len(pieces) == 1 + -(-300 // SEGMENT_STEP_ROWS) + len(SEGMENT_GAUGES)
    text = b"".join(pieces)
    names = [family.name for family in text_string_to_metric_families(text.decode())]
    assert len(names) == len(set(names))   # each family once
    reference = CollectorRegistry()

    class Segments:
        def collect(self):  # type: ignore[no-untyped-def]
            for name, help_text, field in SEGMENT_GAUGES:
                family = GaugeMetricFamily(name, help_text, labels=["segment", "client", "tier"])
                for row in core.stats().segments:
                    family.add_metric([row.segment_id, row.client_id, row.tier.name],
                                      getattr(row, field))
                yield family

    reference.register(Segments())  # type: ignore[arg-type]
    expected = generate_latest(reference)
    assert expected in text   # byte for byte, odd id and all
    used = {s.labels["segment"]: s.value for family in text_string_to_metric_families(
        text.decode()) if family.name == "kvpool_segment_used_bytes" for s in family.samples}
    assert len(used) == 300 and ODD_ID in used and sum(used.values()) >= 50 * 5000


def _at_once(core: MasterCore) -> dict[str, Any]:
    """The status document's core part, every segment's row from the stats at once."""
    stats = core.stats()
    return status_from_stats(stats, list(map(segment_row, stats.segments)))


def test_the_status_document_made_in_steps_is_the_one_made_at_once() -> None:
    core = _core(300)
    metrics = MasterMetrics(core, ServingClock(), master_id="m")
    pieces = list(metrics.status_text_steps())
    assert len(pieces) > 300 // SEGMENT_STEP_ROWS
    stepped = json.loads("".join(pieces))
    whole = _at_once(core)
    assert len(whole["segments"]["list"]) == 300
    assert {k: stepped[k] for k in whole} == whole   # and the master's own fields besides
    assert json.loads("".join(metrics.status_text_steps(indent=2)))["segments"] == \
        whole["segments"]


class _Observer:
    def rpc_done(self, method: str, transport: str, duration_s: float, failed: bool) -> None:
        pass


async def test_get_stats_answers_the_document_made_in_steps() -> None:
    core = _core(300)
    metrics = MasterMetrics(core, ServingClock(), master_id="m")
    servicer = Servicer(core, ServingClock(), _Observer(), master_id="m",
                        on_events=lambda events: True,
                        status_document=metrics.status_text_steps)
    call = calls.get_stats()
    answer = servicer.serve(call.method, call.request.SerializeToString(), "test")
    assert isinstance(answer, Stepped)
    document = call.decode(call.method.response_type.FromString(await answer.answer()))
    assert document["segments"] == _at_once(core)["segments"]
    assert len(document["segments"]["list"]) == 300


@pytest.mark.parametrize("path", ["/metrics", "/status"])
async def test_a_scrape_lets_the_loop_serve_between_its_steps(path: str) -> None:
    core = _core(3000)
    endpoint = HttpEndpoint(MasterMetrics(core, ServingClock(), master_id="m"))
    port = await endpoint.start("127.0.0.1", 0)
    turns = 0
    scraping = True

    async def other_work() -> None:
        nonlocal turns
        while scraping:
            turns += 1
            await asyncio.sleep(0)

    worker = asyncio.get_running_loop().create_task(other_work())
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        await writer.drain()
        await asyncio.sleep(0)   # the request is in: count the turns from here
        before = turns
        answer = await asyncio.wait_for(reader.read(), 30)
        during = turns - before
        writer.close()
    finally:
        scraping = False
        await worker
        await endpoint.close()
    assert answer.startswith(b"HTTP/1.1 200 OK")
    body = answer.split(b"\r\n\r\n", 1)[1]
    if path == "/metrics":
        assert body.count(b"kvpool_segment_used_bytes{") == 3000
    else:
        assert len(json.loads(body)["segments"]["list"]) == 3000
    # the other task ran between the steps (one turn at most if the scrape held the loop)
    assert during >= 3000 // SEGMENT_STEP_ROWS
