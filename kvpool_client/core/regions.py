"""Regions: an object is the concatenation of its regions (``list[memoryview]`` of unsigned
bytes, in order), and its checksum."""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

Regions = list[memoryview]


def total_bytes(regions: Regions) -> int:
    """Return the size of the object the regions hold."""
    return sum(r.nbytes for r in regions)


def trim_regions(regions: Regions, size_bytes: int) -> Regions:
    """Return views covering exactly the first ``size_bytes`` of ``regions`` (drops empty ones).

    Callers check that the regions hold at least ``size_bytes``.
    """
    out: Regions = []
    left = size_bytes
    for region in regions:
        if left <= 0:
            break
        take = min(left, region.nbytes)
        if take:
            out.append(region if take == region.nbytes else region[:take])
        left -= take
    return out


def checksum(regions: Sequence[memoryview]) -> int:
    """Return the xxh3_64 of the concatenated regions (0 is reserved for 'none', so mapped to 1)."""
    if len(regions) == 1:
        value = xxhash.xxh3_64_intdigest(regions[0])
    else:
        hasher = xxhash.xxh3_64()
        for region in regions:
            hasher.update(region)
        value = hasher.intdigest()
    return value or 1
