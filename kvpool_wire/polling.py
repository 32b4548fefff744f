"""When to busy-poll: the backoff shared by the client's blocking master calls and the master's
lingers after serving (``lean_blocking``, ``kvpool_master.rpc.busypoll``).

Polling pays when the awaited bytes come within the budget, and is wasted CPU when they do not.
So every chance polls until one runs out of budget; then the next 1, 2, 4 ... ``MAX_SKIPS``
chances are skipped (doubling while polls keep running out), and a poll that sees its bytes
in time resets it.
"""

from __future__ import annotations

MAX_SKIPS = 64


class PollBackoff:
    """Decides, chance by chance, whether to poll; see the module docstring."""

    __slots__ = ("_skips", "_left")

    def __init__(self) -> None:
        self._skips = 0  # chances skipped after the last poll that ran out
        self._left = 0  # of those, still to skip

    def take(self) -> bool:
        """True when this chance should poll (False: sleep at once)."""
        if self._left:
            self._left -= 1
            return False
        return True

    def paid(self) -> None:
        """A poll saw its bytes within the budget."""
        self._skips = 0

    def ran_out(self) -> None:
        """A poll used its whole budget in vain."""
        self._skips = min(max(1, 2 * self._skips), MAX_SKIPS)
        self._left = self._skips

    @property
    def state(self) -> tuple[int, int]:
        """(chances left to skip, current skip length), for tests and debugging."""
        return self._left, self._skips
