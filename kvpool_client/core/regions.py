"""Regions: an object is the concatenation of its regions (``list[memoryview]`` of unsigned
bytes, in order), and its checksum.

A region may also be an ``AddressRange``: memory known by address only (a device tensor, or
host memory registered with the transfer engine), which only the engine transport moves. An
object with such a region gets no checksum (its bytes are not readable here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import xxhash


@dataclass(frozen=True, slots=True)
class AddressRange:
    """``nbytes`` bytes at ``address`` in this process, registered with the transfer engine
    (``register_memory``); the engine moves them in place, no other transport can."""

    address: int
    nbytes: int


Regions = list[memoryview]
#: what callers may hand in: host views, or ranges known by address (``AddressRange``)
AnyRegions = list[memoryview | AddressRange]


def by_address(regions: Sequence[object]) -> bool:
    """Whether any region is an ``AddressRange``."""
    for region in regions:  # noqa: SIM110 (every read and put asks: no generator)
        if type(region) is AddressRange:
            return True
    return False


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
            if take == region.nbytes:
                out.append(region)
            elif isinstance(region, AddressRange):  # an AnyRegions list
                out.append(AddressRange(region.address, take))
            else:
                out.append(region[:take])
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
