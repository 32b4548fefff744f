"""Client metrics in the client's own Prometheus registry (the host process decides to serve it).

Names follow the master's conventions: ``kvpool_client_`` prefix, ``_total`` counters, ``_bytes``
and ``_seconds`` units.

NOTE: the hot path only adds to plain Python numbers (a dict lookup and an add, well under a
microsecond); the Prometheus families are built when the registry is scraped. prometheus_client's
own Counter/Histogram take a lock per update, which cost several microseconds per put or get.
Each number is updated by one thread (the client's loop, or the heartbeat thread), so the GIL
is all the synchronisation needed.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvpool_wire.status import Status

LATENCY_BUCKETS_S = (25e-6, 50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 1.6e-3, 3.2e-3, 6.4e-3,
                     12.8e-3, 25.6e-3, 51.2e-3, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4)


class Histogram:
    """Bucket counts and sum of observed values (buckets as Prometheus ``le`` bounds)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count one value."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        """``(le, count of values <= le)`` pairs, ending with ``+Inf``."""
        out: list[tuple[str, float]] = []
        total = 0
        for bound, count in zip((*map(repr, self.bounds), "+Inf"), list(self.counts),
                                strict=True):
            total += count
            out.append((bound, total))
        return out

    @property
    def count(self) -> int:
        """Number of observed values."""
        return sum(self.counts)


class ClientMetrics:
    """Counters, gauges and histograms of one client; ``registry`` serves them."""

    def __init__(self) -> None:
        self.transfer_bytes: dict[tuple[str, str], int] = {}
        self.transfer_seconds: dict[tuple[str, str], Histogram] = {}
        self.op_seconds: dict[str, Histogram] = {}
        self.op_failures: dict[tuple[str, str], int] = {}
        self.lookup_keys = 0
        self.lookup_hits = 0
        self.async_queue_depth = 0
        self.async_failures = 0
        self.reregistrations = 0
        self.heartbeat_failures = 0
        self.segment_page_bytes: dict[str, int] = {}  # page size ("4KiB", "2MiB") -> bytes
        self._refusals: Callable[[], dict[str, int]] = dict
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_Collector(self))

    def observe_transfer(self, transport: str, op: str, num_bytes: int, seconds: float) -> None:
        """Count one transfer call (single or batch) of ``num_bytes`` taking ``seconds``."""
        key = (transport, op)
        histogram = self.transfer_seconds.get(key)
        if histogram is None:
            histogram = self.transfer_seconds[key] = Histogram()
            self.transfer_bytes[key] = 0
        histogram.observe(seconds)
        self.transfer_bytes[key] += num_bytes

    def observe_op(self, op: str, seconds: float) -> None:
        """Record the latency of one API call."""
        histogram = self.op_seconds.get(op)
        if histogram is None:
            histogram = self.op_seconds[op] = Histogram()
        histogram.observe(seconds)

    def count_failures(self, op: str, statuses: Iterable[int]) -> None:
        """Count the statuses of one call that are failures, by status name."""
        for status in statuses:
            if status < 0:
                key = (op, Status(status).name)
                self.op_failures[key] = self.op_failures.get(key, 0) + 1

    def count_lookups(self, num_keys: int, num_hits: int) -> None:
        """Count looked-up keys and how many were found."""
        self.lookup_keys += num_keys
        self.lookup_hits += num_hits

    def watch_refusals(self, read: Callable[[], dict[str, int]]) -> None:
        """Expose the data server's refusal counters, read by ``read`` at each scrape."""
        self._refusals = read

    def refusals(self) -> dict[str, int]:
        """The data server's refusal counters by reason (empty without a data server)."""
        return self._refusals()


class _Collector(Collector):
    """Builds the Prometheus families from a ClientMetrics at scrape time."""

    def __init__(self, metrics: ClientMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._m
        transfer_bytes = CounterMetricFamily("kvpool_client_transfer_bytes",
                                             "Payload bytes moved", labels=["transport", "op"])
        for (transport, op), value in sorted(dict(m.transfer_bytes).items()):
            transfer_bytes.add_metric([transport, op], value)
        yield transfer_bytes
        yield _histograms("kvpool_client_transfer_seconds",
                          "Duration of one transfer call (single or batch)",
                          ["transport", "op"], dict(m.transfer_seconds))
        yield _histograms("kvpool_client_op_seconds", "Latency of client API calls", ["op"],
                          {(op,): h for op, h in dict(m.op_seconds).items()})
        failures = CounterMetricFamily("kvpool_client_op_failures", "Keys that failed, by status",
                                       labels=["op", "status"])
        for (op, status), value in sorted(dict(m.op_failures).items()):
            failures.add_metric([op, status], value)
        yield failures
        yield CounterMetricFamily("kvpool_client_lookup_keys",
                                  "Keys looked up (get, exists, query_prefix)",
                                  value=m.lookup_keys)
        yield CounterMetricFamily("kvpool_client_lookup_hits", "Looked-up keys that were found",
                                  value=m.lookup_hits)
        yield GaugeMetricFamily("kvpool_client_async_write_queue_depth",
                                "Objects queued by async writes and not yet written",
                                value=m.async_queue_depth)
        yield CounterMetricFamily("kvpool_client_async_write_failures",
                                  "Async writes (and pipelined commits) that failed",
                                  value=m.async_failures)
        yield CounterMetricFamily("kvpool_client_reregistrations",
                                  "Times this client re-registered with the master",
                                  value=m.reregistrations)
        yield CounterMetricFamily("kvpool_client_heartbeat_failures",
                                  "Heartbeats that got no answer or UNKNOWN_CLIENT",
                                  value=m.heartbeat_failures)
        segment_bytes = GaugeMetricFamily("kvpool_client_segment_bytes",
                                          "Bytes of DRAM this client contributes, by the page "
                                          "size the kernel backs them with",
                                          labels=["page_size"])
        for page_size, value in sorted(m.segment_page_bytes.items()):
            segment_bytes.add_metric([page_size], value)
        yield segment_bytes
        refusals = CounterMetricFamily("kvpool_client_data_server_refusals",
                                       "Data-plane requests this client's data server refused",
                                       labels=["reason"])
        for reason, count in sorted(m.refusals().items()):
            refusals.add_metric([reason], count)
        yield refusals


def _histograms(name: str, documentation: str, labels: list[str],
                label_to_histogram: dict[Any, Histogram]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, documentation, labels=labels)
    for label_values, histogram in sorted(label_to_histogram.items()):
        family.add_metric(list(label_values), histogram.cumulative(), histogram.sum)
    return family
