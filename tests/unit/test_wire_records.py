"""``fast_init`` changes only how a frozen dataclass is built: the instances are the ones the
dataclass's own constructor makes, still frozen; classes it cannot build right are refused.
The master's ``Extent`` (a replica without a capability) compares by value."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from kvpool_master.core.events import ObjectCommitted, ReplicasChanged
from kvpool_wire.records import fast_init
from kvpool_wire.types import Extent, Pin, Placement, SegmentId


def test_instances_match_the_dataclass_constructor_and_stay_frozen() -> None:
    built = Placement("seg", 4096, 100, put_id=7)
    assert built == Placement(segment_id="seg", offset=4096, length=100,
                              capability_expiry_ms=0, capability=b"", put_id=7)
    assert (built.capability_expiry_ms, built.capability) == (0, b"")   # defaults
    assert hash(built) == hash(dataclasses.replace(built))
    assert pickle.loads(pickle.dumps(built)) == built
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.offset = 0  # type: ignore[misc]
    with pytest.raises(TypeError):
        Placement("seg", 1)  # type: ignore[call-arg]   # a field without a default
    event = ReplicasChanged(b"k", 1, (built,), 2, Pin.SOFT, None)
    assert isinstance(event, ObjectCommitted) and event.placements == (built,)
    assert event.pin is Pin.SOFT and event.parent_key is None


def test_classes_it_cannot_build_right_are_refused() -> None:
    @dataclasses.dataclass(slots=True)
    class Mutable:
        a: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class Factory:
        a: list[int] = dataclasses.field(default_factory=list)

    @dataclasses.dataclass(frozen=True, slots=True)
    class Checked:
        a: int

        def __post_init__(self) -> None:
            pass

    for cls in (Mutable, Factory, Checked):
        with pytest.raises(TypeError):
            fast_init(cls)


def test_an_extent_compares_by_value_and_is_no_placement() -> None:
    extent = Extent(SegmentId("seg"), 4096, 100)
    same = Extent(SegmentId("seg"), 4096, 100)
    assert extent == same and hash(extent) == hash(same) and {extent, same} == {extent}
    assert extent != Extent(SegmentId("seg"), 8192, 100)
    assert extent != Placement("seg", 4096, 100) and Placement("seg", 4096, 100) != extent
    assert repr(extent) == "Extent('seg', 4096, 100)"
    assert not hasattr(extent, "capability")   # the master keeps no capability
