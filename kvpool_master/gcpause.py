"""Keep Python's cyclic garbage collector from stalling the master, and count its pauses.

Rules of this file:
- After every full (generation 2) collection, everything that survived it is frozen
  (``gc.freeze``): it is live, and the object table is most of it. Later collections walk only
  what was allocated since, so a pause is bounded by the allocations between collections and
  not by the size of the table (``benchmarks/master_core.py`` measures it; figures in the
  README).
- What start-up left live is collected and frozen before the first call
  (``freeze_start_up``), so no collection while serving walks the imported modules.
- The server's tick also runs a full collection (``collect_recent``) whenever objects left
  the youngest generation since the last one. The collector starts a full collection of its
  own once a quarter of what survived the last one is new: after a freeze, with a table of
  millions, that is hundreds of thousands of objects walked in one pause. Collected every
  tick instead, a pause walks what one tick interval allocated, and the survivors are frozen
  at once.
- The price: a reference cycle among frozen objects that later becomes garbage is never
  collected. The master's tables leave no cycles behind: the recency list links entries both
  ways, and every way out of the table unlinks the entry (``core/objects.py``), so reference
  counting frees it (restore freezes the tables for the same reason, ``persist.py``). What
  could leak is a cycle the event loop had in flight at the instant of a freeze and dropped
  later, a few objects per full collection.
- Pauses are counted per generation (count, total and longest seconds) and exported as
  ``kvpool_master_gc_*`` metrics with the number of frozen objects.
"""

from __future__ import annotations

import gc
import time
from typing import Any


class GcPauses:
    """Times every collection; with ``freeze``, freezes the survivors of each full one."""

    def __init__(self, *, freeze: bool = True) -> None:
        self.freeze = freeze
        self.collections = [0, 0, 0]
        self.pause_s = [0.0, 0.0, 0.0]
        self.longest_pause_s = [0.0, 0.0, 0.0]
        self._started_s = 0.0
        self._installed = False
        self._counting = True

    def install(self) -> None:
        """Start timing (idempotent)."""
        if not self._installed:
            gc.callbacks.append(self._on_gc)
            self._installed = True

    def uninstall(self) -> None:
        """Stop timing (idempotent); what was frozen stays frozen."""
        if self._installed:
            gc.callbacks.remove(self._on_gc)
            self._installed = False

    def freeze_start_up(self) -> None:
        """Collect and freeze what start-up left live (imported modules, a restored index)
        before the first call, without counting it as a pause: the first tick's collection
        would otherwise walk all of it while serving (15-19 ms here)."""
        if self.freeze:
            self._counting = False
            try:
                gc.collect(2)
                gc.freeze()
            finally:
                self._counting = True

    def collect_recent(self) -> None:
        """A full collection now when objects left the youngest generation since the last
        one (its survivors are frozen by the callback); nothing when ``freeze`` is off."""
        if self.freeze:
            _, young, old = gc.get_count()
            if young or old:
                gc.collect(2)

    @property
    def frozen_objects(self) -> int:
        """Objects in the permanent generation."""
        return gc.get_freeze_count()

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started_s = time.perf_counter()
            return
        generation = int(info.get("generation", 2))
        if not self._counting:
            return
        paused_s = time.perf_counter() - self._started_s
        self.collections[generation] += 1
        self.pause_s[generation] += paused_s
        if paused_s > self.longest_pause_s[generation]:
            self.longest_pause_s[generation] = paused_s
        if self.freeze and generation == 2:
            gc.freeze()
