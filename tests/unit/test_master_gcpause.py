"""The master's collector policy with the real collector: survivors of a full collection are
frozen, so the next full collection does not walk them; every pause is counted."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from kvpool_master.gcpause import GcPauses


class Node:
    __slots__ = ("next",)

    def __init__(self) -> None:
        self.next: object = None


@pytest.fixture
def pauses() -> Iterator[GcPauses]:
    gc.collect()
    frozen_before = gc.get_freeze_count()
    timer = GcPauses()
    timer.install()
    try:
        yield timer
    finally:
        timer.uninstall()
        if frozen_before == 0:
            gc.unfreeze()  # give the rest of the test session its collector back


def test_full_collections_freeze_their_survivors(pauses: GcPauses) -> None:
    table = [Node() for _ in range(50_000)]  # what the master keeps: live, no cycles
    gc.collect()
    assert pauses.collections[2] >= 1 and pauses.pause_s[2] > 0
    assert pauses.frozen_objects >= len(table)
    assert gc.get_count()[0] < 100  # the collection ran: its counts start over
    cycle = Node()
    cycle.next = cycle
    del cycle  # garbage made after the freeze is still collected
    assert gc.collect() >= 1
    assert pauses.longest_pause_s[2] >= pauses.pause_s[2] / pauses.collections[2]


def test_without_freeze_pauses_are_only_counted() -> None:
    gc.collect()
    frozen = gc.get_freeze_count()
    timer = GcPauses(freeze=False)
    timer.install()
    timer.install()  # idempotent
    try:
        gc.collect()
        assert timer.collections[2] == 1 and gc.get_freeze_count() == frozen
    finally:
        timer.uninstall()
        timer.uninstall()
    gc.collect()
    assert timer.collections[2] == 1  # no longer timing


def test_collect_recent_freezes_what_a_tick_allocated_and_skips_an_idle_one(
        pauses: GcPauses) -> None:
    gc.collect()
    collections = pauses.collections[2]
    pauses.collect_recent()                # nothing left the youngest generation since
    assert pauses.collections[2] == collections
    table = [Node() for _ in range(20_000)]  # a tick's worth of new objects
    frozen = pauses.frozen_objects
    pauses.collect_recent()
    assert pauses.collections[2] == collections + 1
    assert pauses.frozen_objects >= frozen + len(table)
    assert gc.get_count()[1:] == (0, 0)


def test_what_start_up_left_is_frozen_before_serving_and_not_counted(pauses: GcPauses) -> None:
    modules = [Node() for _ in range(50_000)]   # what imports and a restore leave live
    pauses.freeze_start_up()
    assert pauses.frozen_objects >= len(modules)
    assert pauses.collections[2] == 0           # not a pause: nothing was served yet
    served = [Node() for _ in range(2000)]      # some of it outlived a young collection
    pauses.collect_recent()                     # the first tick walks what came since
    assert pauses.collections[2] == 1 and served
