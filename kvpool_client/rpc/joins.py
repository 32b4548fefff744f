"""Joining the answers of a batch sent as several calls (``rpc.session``): each call carries
the keys of one route, a partition and the positions of its keys in the batch.

Rules of this file:
- A route's positions are a ``range`` when its keys are a slice of the batch (one master
  process: the calls split it in order) or a list (a partitioned master: each partition's
  keys, in batch order); the joined answer has every key's result at its position.
- A part that failed fails its own keys (``failed(status)`` each); the batch raises only
  when every part failed, as a single call would.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvpool_wire import calls
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import Placement, ReadResult

T = TypeVar("T")

#: (partition, the positions in the batch of the keys one call carries)
Route = tuple[int, range | list[int]]


def picked(items: Sequence[T], positions: range | list[int]) -> Sequence[T]:
    """The items at ``positions`` (a slice when they are a range)."""
    if type(positions) is range:
        return items[positions.start:positions.stop]
    return list(map(items.__getitem__, positions))


def _check_parts(results: list[Any]) -> None:
    """Raise the first error when every part failed (the batch failed as one call would)."""
    if all(isinstance(r, KVPoolError) for r in results):
        raise results[0]


def _in_order(routes: Sequence[Route]) -> bool:
    """Whether the routes are slices of the batch, in order (their answers concatenate)."""
    return all(type(positions) is range for _, positions in routes)


def _placed(routes: Sequence[Route], parts: list[list[Any]]) -> list[Any]:
    """Each part's items at its route's positions."""
    if _in_order(routes):
        out: list[Any] = []
        for part in parts:
            out.extend(part)
        return out
    placed: list[Any] = [None] * sum(len(positions) for _, positions in routes)
    for part, (_, positions) in zip(parts, routes, strict=True):
        for position, item in zip(positions, part, strict=True):
            placed[position] = item
    return placed


def joined_lists(routes: Sequence[Route], failed: Callable[[Status], Any],
                 results: list[Any]) -> list[Any]:
    """The per-key lists of the parts, each key's at its position; ``failed(status)`` for
    each key of a part that raised."""
    _check_parts(results)
    return _placed(routes, [[failed(part.status)] * len(positions)
                            if isinstance(part, KVPoolError) else part
                            for part, (_, positions) in zip(results, routes, strict=True)])


def joined_exist(routes: Sequence[Route],
                 results: list[Any]) -> tuple[list[Status], list[int]]:
    """Exist's (statuses, sizes) of the parts."""
    _check_parts(results)
    statuses = _placed(routes, [[part.status] * len(positions) if isinstance(part, KVPoolError)
                                else part[0] for part, (_, positions)
                                in zip(results, routes, strict=True)])
    sizes = _placed(routes, [[0] * len(positions) if isinstance(part, KVPoolError) else part[1]
                             for part, (_, positions) in zip(results, routes, strict=True)])
    return statuses, sizes


def joined_prefix(routes: Sequence[Route], results: list[Any]) -> int:
    """The leading keys found: the position of the first key some part did not find (each
    part counts its own keys, in batch order, up to its first miss). A part that failed
    counts as missing its first key, and fails the call when it holds the batch's first key.
    (Sent together, parts may lease keys past the first miss; their leases run out.)"""
    first_miss = sum(len(positions) for _, positions in routes)
    for part, (_, positions) in zip(results, routes, strict=True):
        found = 0 if isinstance(part, KVPoolError) else int(part)
        if found < len(positions):
            if isinstance(part, KVPoolError) and positions[0] == 0:
                raise part
            first_miss = min(first_miss, positions[found])
    return first_miss


def joined_replicas(routes: Sequence[Route],
                    results: list[Any]) -> calls.ReplicasAnswer:
    """One answer: the results at their positions, the shortest lease, every lease's id."""
    _check_parts(results)
    lease_ttl_s = min(r.lease_ttl_s for r in results if not isinstance(r, KVPoolError))
    lease_ids: list[int] = []
    parts: list[list[ReadResult[Placement]]] = []
    for part, (_, positions) in zip(results, routes, strict=True):
        if isinstance(part, KVPoolError):
            parts.append([ReadResult(part.status, 0, (), 0)] * len(positions))
        else:
            parts.append(part.results)
            lease_ids.extend(part.lease_ids)
    return calls.ReplicasAnswer(_placed(routes, parts), lease_ttl_s, tuple(lease_ids))


def all_ok(statuses: list[Any]) -> Status:
    """The one status of a call made on every partition: OK when every one answered OK, else
    the first other answer. A part that raised raises (the first such), as the call to one
    master process would: a caller that makes the call again on a TIMEOUT (a mount waiting
    for a sweep) must see it as one."""
    for status in statuses:
        if isinstance(status, KVPoolError):
            raise status
    for status in statuses:
        if status != Status.OK:
            return Status(status)
    return Status.OK


def summed(counts: list[Any]) -> int:
    """How many, over every partition (raises the first failure)."""
    for count in counts:
        if isinstance(count, KVPoolError):
            raise count
    return sum(counts)


#: the parts of a status document a partitioned master's partitions each count for their
#: own share (summed); the rest (clients, segments mounted, engine endpoints) every
#: partition knows whole
_SUMMED = ("capacity_bytes", "used_bytes", "objects", "totals", "tier_copies")
#: totals every partition counts for the same client (it registers with and expires on each)
_PER_CLIENT_TOTALS = ("clients_registered_total", "clients_expired_total")


def merged_status(documents: list[Any]) -> dict[str, Any]:
    """One status document of a partitioned master from each partition's (raises the first
    failure): the counts of each partition's share summed, each segment's capacity and use
    summed over the partitions' shares of it, the longest stall of any and the most clients
    registered or expired by any; ``partitions`` says how many and ``partition_list`` what
    each holds."""
    for document in documents:
        if isinstance(document, KVPoolError):
            raise document
    merged: dict[str, Any] = copy.deepcopy(documents[0])
    for document in documents[1:]:
        for name in _SUMMED:
            if name in merged and name in document:
                merged[name] = _sum_numbers(merged[name], document[name])
        by_id = {s.get("segment_id"): s for s in merged.get("segments", {}).get("list", [])}
        for segment in document.get("segments", {}).get("list", []):
            mine = by_id.get(segment.get("segment_id"))
            if mine is None:
                continue
            for name in ("capacity_bytes", "used_bytes", "free_extents"):
                mine[name] = mine.get(name, 0) + segment.get(name, 0)
            mine["largest_free_bytes"] = max(mine.get("largest_free_bytes", 0),
                                             segment.get("largest_free_bytes", 0))
    totals = merged.get("totals")
    if isinstance(totals, dict):   # every partition counts each client: the most of any
        for name in _PER_CLIENT_TOTALS:
            if name in totals:
                totals[name] = max(d.get("totals", {}).get(name, 0) for d in documents)
    merged.pop("partition", None)   # partition 0's own place
    merged["partitions"] = len(documents)
    merged["stalled_s"] = max(float(d.get("stalled_s", 0.0)) for d in documents)
    merged["partition_list"] = [_partition_row(index, document)
                                for index, document in enumerate(documents)]
    return merged


def _partition_row(index: int, document: dict[str, Any]) -> dict[str, Any]:
    """What one partition holds, for a merged document's ``partition_list`` (an operator
    sees a partition that lags or holds more than its share)."""
    objects = document.get("objects", {})
    return {"index": index, "ready": objects.get("ready", 0),
            "pending": objects.get("pending", 0), "ready_bytes": objects.get("ready_bytes", 0),
            "used_bytes": document.get("used_bytes", {}),
            "sweep_backlog_keys": objects.get("sweep_backlog_keys", 0),
            "stalled_s": document.get("stalled_s", 0.0), "uptime_s": document.get("uptime_s")}


def _sum_numbers(mine: Any, theirs: Any) -> Any:
    if isinstance(mine, dict) and isinstance(theirs, dict):
        return {name: _sum_numbers(value, theirs[name]) if name in theirs else value
                for name, value in mine.items()}
    if isinstance(mine, int | float) and not isinstance(mine, bool) \
            and isinstance(theirs, int | float) and not isinstance(theirs, bool):
        return mine + theirs
    return mine
