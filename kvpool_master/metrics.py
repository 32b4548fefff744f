"""Prometheus metrics of the master and its HTTP endpoint (/metrics, /healthz, /status).

Rules of this file:
- One private registry per master (no process-global state), names ``kvpool_*`` with the
  Prometheus unit suffixes (``_total``, ``_bytes``, ``_seconds``).
- State gauges and the core's own counters (puts, evictions, leases, lookups, expiries) are
  read from ``core.stats()`` at scrape time by a collector; the core never reads metrics.
  Per-call counters and latency histograms are fed by the servicer (``rpc_done``), refusals by
  the transports (``refused``).
- The HTTP endpoint runs on the master's event loop, so reading the core needs no lock; what
  grows with the cluster (a row per segment) is made a step at a time, the loop serving calls
  between the steps: /metrics (``MasterMetrics.exposition_steps``), /status and the
  ``GetStats`` document (``status_text_steps``).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvpool_master.clock import ServingClock
from kvpool_master.core.master import MasterCore
from kvpool_master.core.stats import CoreStats, SegmentStats
from kvpool_master.looplag import LAG_BUCKETS_S
from kvpool_wire.types import Tier

log = logging.getLogger("kvpool.master.metrics")

#: Latency buckets from 20 µs to 2.5 s: the lean path answers in tens of µs, gRPC in hundreds.
LATENCY_BUCKETS_S = (0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01,
                     0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


#: The per-segment gauges: (name, help, ``SegmentStats`` field). A cluster's master knows a
#: segment per worker or more, so /metrics renders these rows a step at a time
#: (``MasterMetrics.exposition_steps``), not through the registry at once.
SEGMENT_GAUGES = (
    ("kvpool_segment_capacity_bytes", "Capacity per segment", "capacity_bytes"),
    ("kvpool_segment_used_bytes", "Allocated bytes per segment", "used_bytes"),
    ("kvpool_segment_largest_free_bytes", "Largest free extent per segment (fragmentation)",
     "largest_free_bytes"),
)
#: Segments one step of /metrics renders (about 6 µs each, its three samples), or of
#: /status and GetStats takes the figures of
SEGMENT_STEP_ROWS = 128
#: Pieces of the JSON encoder one step of /status or GetStats joins (a field or bracket each)
JSON_STEP_PIECES = 4096


def _label_value(text: str) -> str:
    """``text`` escaped as a label value of the Prometheus text format."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class MasterMetrics:
    """The master's registry, fed by the servicer and the event fan-out."""

    def __init__(self, core: MasterCore, clock: ServingClock, *, master_id: str,
                 settings: dict[str, Any] | None = None) -> None:
        self._core = core
        self._settings = dict(settings or {})
        self._clock = clock
        self._master_id = master_id
        self._started_wall_s = time.time()
        #: a partition of a partitioned master: what /status says of it (``partition``)
        self.partition_info: Callable[[], dict[str, Any]] | None = None
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # per call: plain counters, exported at scrape time (a prometheus_client child's
        # inc and observe cost a few microseconds a call, the counters a fraction of that)
        self._rpc_calls: dict[tuple[str, str], RpcCalls] = {}
        r.register(_RpcCollector(self._rpc_calls))
        self.refusals = Counter(
            "kvpool_refusals_total",
            "Connections or calls refused (missing/wrong token, connection limit)",
            ["transport", "reason"], registry=r)
        self.state_write_failures = Counter(
            "kvpool_state_write_failures_total",
            "Times a failed write of --state-dir made the master read-only", registry=r)
        self._state_log_bytes = Gauge("kvpool_state_log_bytes",
                                      "Size of the --state-dir log since the last snapshot",
                                      registry=r)
        self._state_read_only = Gauge(
            "kvpool_state_read_only",
            "1 while a failed write of --state-dir keeps the master read-only (calls that "
            "change the index answer UNAVAILABLE until a full snapshot succeeds)", registry=r)
        self._restore_conflicts = Gauge(
            "kvpool_restore_conflicting_objects",
            "Objects the last restore dropped because their extents overlapped another's",
            registry=r)
        self._restore_seconds = Gauge(
            "kvpool_restore_seconds",
            "How long this master's start took to restore the index from --state-dir (the "
            "restore grace counts from its end)", registry=r)
        self._store: Any = None
        self.registry.register(_CoreCollector(core, clock, master_id))
        self.registry.register(_CompactionCollector(lambda: self._store))

    # -- fed by the servicer ----------------------------------------------------------------------

    def rpc_done(self, method: str, transport: str, duration_s: float, failed: bool) -> None:
        """Count and time one call."""
        calls = self._rpc_calls.get((method, transport))
        if calls is None:
            calls = self._rpc_calls[(method, transport)] = RpcCalls()
        calls.count += 1
        calls.sum_s += duration_s
        calls.buckets[bisect.bisect_left(LATENCY_BUCKETS_S, duration_s)] += 1
        if failed:
            calls.failures += 1

    def refused(self, transport: str, reason: str) -> None:
        """Count one refused connection or call."""
        self.refusals.labels(transport, reason).inc()

    def watch_gc(self, pauses: Any) -> None:
        """Export the collector pauses of ``pauses`` (a gcpause.GcPauses)."""
        self.registry.register(_GcCollector(pauses))

    def watch_loop_lag(self, lag: Any) -> None:
        """Export the samples of ``lag`` (a looplag.LoopLag)."""
        self.registry.register(_LoopLagCollector(lag))

    def watch_busy_poll(self, poller: Any) -> None:
        """Export the lingers of ``poller`` (a busypoll.BusyPoller)."""
        self.registry.register(_BusyPollCollector(poller))

    def watch_store(self, store: Any, report: Any = None, restore_s: float = 0.0) -> None:
        """Export the size and health of the state log of ``store`` (a persist.StateStore),
        what its restore (``report``, a persist.RestoreReport) dropped for conflicts and how
        long it took."""
        self._store = store
        self._state_log_bytes.set_function(lambda: store.log_bytes)
        self._state_read_only.set_function(lambda: 0 if store.healthy else 1)
        if report is not None:
            self._restore_conflicts.set(report.num_conflicting_objects)
        self._restore_seconds.set(restore_s)

    def unhealthy_reason(self) -> str:
        """Why /healthz answers 503 ("" when healthy)."""
        store = self._store
        if store is not None and not store.healthy:
            return f"read-only: cannot write the state directory ({store.failure})"
        return ""

    # -- documents --------------------------------------------------------------------------------

    def exposition_steps(self) -> Iterator[bytes]:
        """Prometheus text of the whole registry and of every segment, in pieces, each made in
        a bounded step (join them; the HTTP endpoint serves other work between steps): the
        registry at once (its families do not grow with the cluster), then the per-segment
        gauges, ``SEGMENT_STEP_ROWS`` segments a step, ending with their text, a gauge a
        step."""
        yield generate_latest(self.registry)
        lines: list[list[str]] = [[] for _ in SEGMENT_GAUGES]
        for rows in self._core.segment_stats_steps(SEGMENT_STEP_ROWS):
            for row in rows:
                labels = (f'{{client="{_label_value(row.client_id)}",'
                          f'segment="{_label_value(row.segment_id)}",tier="{row.tier.name}"}} ')
                for out, (name, _, field) in zip(lines, SEGMENT_GAUGES, strict=True):
                    out.append(f"{name}{labels}{floatToGoString(getattr(row, field))}\n")
            yield b""
        for (name, help_text, _), out in zip(SEGMENT_GAUGES, lines, strict=True):
            yield f"# HELP {name} {help_text}\n# TYPE {name} gauge\n{''.join(out)}".encode()

    def status_text_steps(self, indent: int | None = None) -> Iterator[str]:
        """The /status document (clients, segments, capacity and usage per tier, objects) as
        JSON text, in pieces, each made in a bounded step (join them; ``GetStats`` and the
        HTTP endpoint serve other work between steps): its segment
        rows ``SEGMENT_STEP_ROWS`` a step (empty pieces), then the text, ``JSON_STEP_PIECES``
        pieces of the encoder a step."""
        document: dict[str, Any] | None = None
        for document in self._status_steps():
            if document is None:
                yield ""
        pieces = json.JSONEncoder(indent=indent, sort_keys=True).iterencode(document)
        while chunk := list(itertools.islice(pieces, JSON_STEP_PIECES)):
            yield "".join(chunk)

    def _status_steps(self) -> Iterator[dict[str, Any] | None]:
        """None after each step of segment rows, then the document."""
        rows: list[dict[str, Any]] = []
        for chunk in self._core.segment_stats_steps(SEGMENT_STEP_ROWS):
            rows += map(segment_row, chunk)
            yield None
        document = status_from_stats(self._core.stats(with_segments=False), rows)
        document["master_id"] = self._master_id
        document["uptime_s"] = round(time.time() - self._started_wall_s, 3)
        document["stalled_s"] = round(self._clock.stalled_s, 3)
        document["settings"] = self._settings
        if self.partition_info is not None:
            document["partition"] = self.partition_info()
        yield document

    def mounted_segment_ids(self) -> list[str]:
        """The ids of the segments mounted now (Mooncake's ``/get_all_segments``)."""
        return self._core.mounted_segment_ids()


#: HCCL one-sided pooling: each device links to every other, at most 512 links
HCCL_DEVICE_LIMIT = 512


def segment_row(s: SegmentStats) -> dict[str, Any]:
    """One segment's row of the /status document."""
    return {"segment_id": s.segment_id, "client_id": s.client_id, "tier": s.tier.name,
            "mounted": s.mounted, "capacity_bytes": s.capacity_bytes,
            "used_bytes": s.used_bytes, "free_extents": s.num_free_extents,
            "largest_free_bytes": s.largest_free_bytes}


def status_from_stats(stats: CoreStats, segment_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON-able /status body built from a CoreStats and its segments' rows
    (``segment_row`` of each)."""
    return {
        "clients": stats.num_clients,
        "segments": {"mounted": stats.num_segments, "restored": stats.num_restored_segments,
                     "list": segment_rows},
        # each engine session is one device's engine (MindIE, vllm-ascend: one per worker);
        # HCCL one-sided pooling links every device to every other, at most 512 devices
        "engine": {"endpoints": stats.num_engine_endpoints,
                   "hccl_device_limit": HCCL_DEVICE_LIMIT,
                   "within_hccl_limit": stats.num_engine_endpoints <= HCCL_DEVICE_LIMIT},
        "capacity_bytes": {t.name: n for t, n in stats.tier_to_capacity_bytes.items()},
        "used_bytes": {t.name: n for t, n in stats.tier_to_used_bytes.items()},
        "objects": {"ready": stats.num_objects, "pending": stats.num_pending,
                    "ready_bytes": stats.ready_bytes,
                    "deferred_free_bytes": stats.deferred_free_bytes,
                    "quarantined_bytes": stats.quarantined_bytes,
                    "sweep_backlog_keys": stats.sweep_backlog_keys,
                    "held_extents": stats.held_extents},
        "totals": {name: getattr(stats, name) for name in _COUNTER_FIELDS},
        "tier_copies": {**{name: getattr(stats, name) for name in _COPIES},
                        "in_flight": stats.copies_in_flight},
    }


#: CoreStats counter field -> (metric name, help). Every one is exported as a counter.
_COUNTERS: dict[str, tuple[str, str]] = {
    "put_started_total": ("kvpool_puts_started_total", "Keys given placements by PutStart"),
    "put_committed_total": ("kvpool_puts_committed_total", "Keys committed by PutEnd"),
    "put_revoked_total": ("kvpool_puts_revoked_total", "Keys revoked by PutRevoke"),
    "put_no_space_total": ("kvpool_puts_no_space_total",
                           "Keys answered NO_SPACE (nothing evictable was left)"),
    "evicted_objects_total": ("kvpool_evicted_objects_total", "Objects evicted"),
    "evicted_bytes_total": ("kvpool_evicted_bytes_total",
                            "Allocated bytes freed by eviction (all replicas)"),
    "eviction_passes_total": ("kvpool_eviction_passes_total", "Eviction passes run"),
    "removed_objects_total": ("kvpool_removed_objects_total",
                              "Objects removed by Remove, RemoveAll and RemoveByRegex"),
    "segment_lost_objects_total": ("kvpool_segment_lost_objects_total",
                                   "Objects dropped because their segments went away"),
    "pending_reclaimed_total": ("kvpool_pending_reclaimed_total",
                                "Uncommitted puts reclaimed (writer gone or too slow)"),
    "clients_registered_total": ("kvpool_clients_registered_total", "Client registrations"),
    "clients_expired_total": ("kvpool_clients_expired_total",
                              "Clients expired for missing heartbeats"),
    "registrations_refused_total": ("kvpool_registrations_refused_total",
                                    "Registrations of a known client id without its token"),
    "calls_unauthenticated_total": ("kvpool_calls_unauthenticated_total",
                                    "Client-scoped calls refused for a wrong client token"),
    "leases_granted_total": ("kvpool_leases_granted_total",
                             "Read leases granted or extended (one per key read)"),
    "leases_lapsed_total": ("kvpool_leases_expired_total", "Read leases that ran out"),
    "leases_ended_total": ("kvpool_leases_ended_total",
                           "Read holds ended by their reader once it finished reading"),
    "lookup_queries_total": ("kvpool_lookup_queries_total", "QueryPrefix calls"),
    "lookup_keys_total": ("kvpool_lookup_blocks_total", "Blocks asked for by QueryPrefix"),
    "lookup_hit_keys_total": ("kvpool_lookup_hit_blocks_total",
                              "Leading READY blocks answered by QueryPrefix "
                              "(pool hit rate = hit_blocks / blocks)"),
    "read_keys_total": ("kvpool_read_keys_total", "Keys asked for by GetReplicas and Exist"),
    "read_hit_keys_total": ("kvpool_read_hit_keys_total",
                            "Keys found READY by GetReplicas and Exist"),
    "ssd_read_hit_keys_total": ("kvpool_ssd_read_hit_keys_total",
                                "Keys GetReplicas found on SSD only (the SSD tier's hits)"),
    "evicted_replicas_total": ("kvpool_evicted_replicas_total",
                               "Objects evicted from one tier that live on in another"),
    "copies_expired_total": ("kvpool_tier_copies_expired_total",
                             "Tier copies their owner did not report within copy_task_ttl"),
}
#: CoreStats tier copy counters -> (kind, result) of kvpool_tier_copies_total
_COPIES = {"demotions_started_total": ("demote", "started"),
           "demotions_done_total": ("demote", "done"),
           "demotions_failed_total": ("demote", "failed"),
           "promotions_started_total": ("promote", "started"),
           "promotions_done_total": ("promote", "done"),
           "promotions_failed_total": ("promote", "failed")}
_COUNTER_FIELDS = tuple(_COUNTERS)


class RpcCalls:
    """Calls of one method over one transport: how many, how many failed, their time."""

    __slots__ = ("count", "failures", "sum_s", "buckets")

    def __init__(self) -> None:
        self.count = 0
        self.failures = 0
        self.sum_s = 0.0
        self.buckets = [0] * (len(LATENCY_BUCKETS_S) + 1)  # per bucket; the last is +Inf


class _RpcCollector(Collector):
    """``kvpool_rpc_requests_total``, ``kvpool_rpc_failures_total`` and the histogram
    ``kvpool_rpc_duration_seconds`` per method and transport, from the servicer's counts."""

    def __init__(self, calls: dict[tuple[str, str], RpcCalls]) -> None:
        self._calls = calls

    def collect(self) -> Iterator[Metric]:
        labels = ["method", "transport"]
        requests = CounterMetricFamily("kvpool_rpc_requests", "Master calls served",
                                       labels=labels)
        failures = CounterMetricFamily(
            "kvpool_rpc_failures",
            "Master calls that failed as a whole (malformed request or internal error)",
            labels=labels)
        latency = HistogramMetricFamily("kvpool_rpc_duration_seconds",
                                        "Time the master spent serving one call", labels=labels)
        bounds = [repr(float(b)) for b in LATENCY_BUCKETS_S] + ["+Inf"]
        for (method, transport), calls in sorted(self._calls.items()):
            requests.add_metric([method, transport], calls.count)
            failures.add_metric([method, transport], calls.failures)
            latency.add_metric([method, transport],
                               list(zip(bounds, itertools.accumulate(calls.buckets),
                                        strict=True)), calls.sum_s)
        yield requests
        yield failures
        yield latency


class _CoreCollector(Collector):
    """Gauges and counters read from ``core.stats()`` at scrape time."""

    def __init__(self, core: MasterCore, clock: ServingClock, master_id: str) -> None:
        self._core = core
        self._clock = clock
        self._master_id = master_id
        self._started_wall_s = time.time()

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("kvpool_master_info", "Identity of this master process",
                                 labels=["master_id"])
        info.add_metric([self._master_id], 1)
        yield info
        yield GaugeMetricFamily("kvpool_master_start_time_seconds",
                                "Unix time the master started", value=self._started_wall_s)
        yield CounterMetricFamily("kvpool_master_stalled_seconds",
                                  "Time the master was not serving (excluded from deadlines)",
                                  value=self._clock.stalled_s)
        yield from core_metrics(self._core.stats(with_segments=False))


class _BusyPollCollector(Collector):
    """What busy polling cost and how often it saved a wake-up."""

    def __init__(self, poller: Any) -> None:
        self._poller = poller

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("kvpool_busy_poll_seconds",
                                  "Time the master polled its lean connections instead of "
                                  "sleeping", value=self._poller.polled_s)
        lingers = CounterMetricFamily("kvpool_busy_poll_lingers",
                                      "Busy polls after serving, by outcome (hit: a call came "
                                      "in; miss: none did within --busy-poll-us)",
                                      labels=["outcome"])
        lingers.add_metric(["hit"], self._poller.num_hits)
        lingers.add_metric(["miss"], self._poller.num_misses)
        yield lingers


class _GcCollector(Collector):
    """How long Python's cyclic collector paused the master, per generation."""

    def __init__(self, pauses: Any) -> None:
        self._pauses = pauses

    def collect(self) -> Iterator[Metric]:
        p = self._pauses
        collections = CounterMetricFamily("kvpool_master_gc_collections",
                                          "Cyclic garbage collections", labels=["generation"])
        paused = CounterMetricFamily("kvpool_master_gc_pause_seconds",
                                     "Time the master spent in cyclic garbage collections",
                                     labels=["generation"])
        longest = GaugeMetricFamily("kvpool_master_gc_longest_pause_seconds",
                                    "Longest single collection since start",
                                    labels=["generation"])
        for generation in range(3):
            label = [str(generation)]
            collections.add_metric(label, p.collections[generation])
            paused.add_metric(label, p.pause_s[generation])
            longest.add_metric(label, p.longest_pause_s[generation])
        yield collections
        yield paused
        yield longest
        yield GaugeMetricFamily("kvpool_master_gc_frozen_objects",
                                "Objects frozen out of the collector's reach (they survived a "
                                "full collection)", value=p.frozen_objects)


class _LoopLagCollector(Collector):
    """How late the master's event loop ran timers that were due (see ``looplag``)."""

    def __init__(self, lag: Any) -> None:
        self._lag = lag

    def collect(self) -> Iterator[Metric]:
        lag = self._lag
        histogram = HistogramMetricFamily(
            "kvpool_master_loop_lag_seconds",
            "How late the event loop ran a timer that was due, sampled every "
            f"{lag.interval_s * 1000:g} ms: the wait a call arriving at that moment saw "
            "before the master got to it (a long step, a collector pause, CPU starvation)")
        bounds = [repr(float(b)) for b in LAG_BUCKETS_S] + ["+Inf"]
        histogram.add_metric([], list(zip(bounds, itertools.accumulate(lag.buckets),
                                          strict=True)), lag.sum_s)
        yield histogram
        yield GaugeMetricFamily("kvpool_master_loop_lag_max_seconds",
                                "The longest lag sampled since start", value=lag.max_s)


class _CompactionCollector(Collector):
    """Compactions of the --state-dir log: how many, and what the last one cost (zeros
    without a state directory, as the other state metrics)."""

    def __init__(self, store: Callable[[], Any]) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        store = self._store()
        yield CounterMetricFamily("kvpool_state_compactions",
                                  "Compactions of the --state-dir log finished since start",
                                  value=store.num_compactions if store is not None else 0)
        last = store.last_compaction if store is not None else None
        yield GaugeMetricFamily("kvpool_state_last_compaction_seconds",
                                "How long the last compaction took, start to swap (0: none yet)",
                                value=last.seconds if last is not None else 0.0)
        yield GaugeMetricFamily("kvpool_state_last_compaction_longest_step_seconds",
                                "The longest time the last compaction held the event loop at "
                                "once (a compaction not written in steps: all of it)",
                                value=last.longest_step_s if last is not None else 0.0)
        yield GaugeMetricFamily("kvpool_state_last_compaction_objects",
                                "Objects the last compaction's snapshot holds",
                                value=last.num_objects if last is not None else 0)


def core_metrics(stats: CoreStats) -> Iterator[Metric]:
    """Metric families of one CoreStats."""
    yield GaugeMetricFamily("kvpool_clients", "Registered clients", value=stats.num_clients)
    segments = GaugeMetricFamily("kvpool_segments", "Segments by state", labels=["state"])
    segments.add_metric(["mounted"], stats.num_segments)
    segments.add_metric(["restored"], stats.num_restored_segments)
    yield segments
    yield GaugeMetricFamily("kvpool_engine_endpoints",
                            "Distinct transfer-engine sessions of mounted segments (devices an "
                            "engine-transport pool spans; HCCL links at most 512)",
                            value=stats.num_engine_endpoints)
    objects = GaugeMetricFamily("kvpool_objects", "Objects by state", labels=["state"])
    objects.add_metric(["ready"], stats.num_objects)
    objects.add_metric(["pending"], stats.num_pending)
    yield objects
    yield GaugeMetricFamily("kvpool_object_bytes", "Logical bytes of READY objects",
                            value=stats.ready_bytes)
    yield GaugeMetricFamily("kvpool_deferred_free_bytes",
                            "Bytes of force-removed objects still held by read leases",
                            value=stats.deferred_free_bytes)
    yield GaugeMetricFamily("kvpool_quarantined_bytes",
                            "Free space of restored segments held back until write "
                            "capabilities of the previous master have run out",
                            value=stats.quarantined_bytes)
    capacity = GaugeMetricFamily("kvpool_capacity_bytes", "Mounted capacity per tier",
                                 labels=["tier"])
    used = GaugeMetricFamily("kvpool_used_bytes", "Allocated bytes per tier", labels=["tier"])
    for tier in Tier:
        capacity.add_metric([tier.name], stats.tier_to_capacity_bytes.get(tier, 0))
        used.add_metric([tier.name], stats.tier_to_used_bytes.get(tier, 0))
    yield capacity
    yield used
    for field_name, (name, help_text) in _COUNTERS.items():
        yield CounterMetricFamily(name, help_text, value=getattr(stats, field_name))
    copies = CounterMetricFamily("kvpool_tier_copies_total",
                                 "Copies between tiers the master asked owners for (demote: "
                                 "DRAM to SSD, promote: SSD to DRAM), by how they ended",
                                 labels=["kind", "result"])
    for field_name, kind_result in _COPIES.items():
        copies.add_metric(list(kind_result), getattr(stats, field_name))
    yield copies
    yield GaugeMetricFamily("kvpool_sweep_backlog_keys",
                            "About how many object-table entries the sweeps of lost segments "
                            "and removal jobs still have to walk (done between requests, a "
                            "step at a time)",
                            value=stats.sweep_backlog_keys)
    yield GaugeMetricFamily("kvpool_removal_held_extents",
                            "Extents of objects that RemoveAll / RemoveByRegex removed, still "
                            "allocated until the job frees them in offset order (a step at a "
                            "time, once its walk is done)",
                            value=stats.held_extents)
    yield GaugeMetricFamily("kvpool_tier_copies_in_flight",
                            "Tier copies waiting for their owner or being made",
                            value=stats.copies_in_flight)


# --- HTTP ----------------------------------------------------------------------------------------

_MAX_REQUEST_HEAD_BYTES = 8192
_REQUEST_TIMEOUT_S = 5.0


class HttpEndpoint:
    """Minimal HTTP/1.1 GET server on the event loop: /metrics, /healthz and /status, and the
    two read-only paths of Mooncake's master that tools poll (SGLang's ``check_server`` waits
    on ``/get_all_segments``): ``/health`` (JSON, always 200, ``service_ready`` false while
    /healthz would answer 503) and ``/get_all_segments`` (mounted segment ids, one a line)."""

    def __init__(self, metrics: MasterMetrics) -> None:
        self._metrics = metrics
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen; return the bound port."""
        self._server = await asyncio.start_server(self._handle, host, port,
                                                  limit=_MAX_REQUEST_HEAD_BYTES)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop listening."""
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    def _route(self, path: str) -> tuple[int, str, bytes]:
        """The answer of a path other than /metrics and /status (made at once)."""
        if path == "/healthz":
            reason = self._metrics.unhealthy_reason()
            if reason:
                return 503, "text/plain; charset=utf-8", f"unhealthy: {reason}\n".encode()
            return 200, "text/plain; charset=utf-8", b"ok\n"
        if path == "/health":
            ready = not self._metrics.unhealthy_reason()
            body = json.dumps({"status": "ok", "role": "leader", "service_ready": ready})
            return 200, "application/json", body.encode()
        if path == "/get_all_segments":
            names = "".join(f"{name}\n" for name in self._metrics.mounted_segment_ids())
            return 200, "text/plain; charset=utf-8", names.encode()
        return 404, "text/plain; charset=utf-8", (b"not found: try /metrics, /healthz, /status, "
                                                  b"/health, /get_all_segments\n")

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _REQUEST_TIMEOUT_S)
            parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            path = parts[1].split("?", 1)[0] if len(parts) == 3 else ""
            if len(parts) != 3 or parts[0] not in ("GET", "HEAD"):
                code, ctype, body = 405, "text/plain; charset=utf-8", b"only GET\n"
            elif path == "/metrics":   # these two grow with the cluster: made in steps
                code, ctype = 200, CONTENT_TYPE_LATEST
                body = await _stepped(self._metrics.exposition_steps())
            elif path == "/status":
                code, ctype = 200, "application/json"
                body = await _stepped(itertools.chain(
                    map(str.encode, self._metrics.status_text_steps(indent=2)), (b"\n",)))
            else:
                code, ctype, body = self._route(path)
            reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed",
                      503: "Service Unavailable"}[code]
            writer.write(f"HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\n"
                         f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
            if parts and parts[0] != "HEAD":
                writer.write(body)
            await asyncio.wait_for(writer.drain(), _REQUEST_TIMEOUT_S)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError,
                ConnectionError, UnicodeDecodeError):
            pass
        except Exception:
            log.exception("HTTP request failed")
        finally:
            writer.close()


async def _stepped(pieces: Iterator[bytes]) -> bytes:
    """The pieces joined, the loop serving other work after each is made."""
    out = []
    for piece in pieces:
        out.append(piece)
        await asyncio.sleep(0)
    return b"".join(out)
