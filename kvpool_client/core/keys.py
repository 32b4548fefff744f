"""One normalisation of a batch's keys, used by every batch call.

The duplicate-key policy, the same for every call: a key that appears more than once in one
batch is acted on once, for its first occurrence (a write stores the first occurrence's value);
every later occurrence reports the first one's result, and a read also gives it the bytes.
A key that is not a valid key fails alone with INVALID_KEY; a value the caller marked unusable
(``None``) fails alone with INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from kvpool_wire.status import KVPoolError, Status

V = TypeVar("V")
KeyLike = str | bytes | bytearray | memoryview


class KeyBatch(Generic[V]):
    """A batch's distinct valid keys (``keys``, with ``values`` and their ``positions`` in the
    caller's batch), and what every other position reports."""

    __slots__ = ("keys", "values", "positions", "_preset", "_repeats", "size")

    def __init__(self, keys: Sequence[Any], values: Sequence[V | None] | None,
                 to_key: Callable[[Any], bytes]) -> None:
        self.size = len(keys)
        self.keys: list[bytes] = []
        self.values: list[V] = []
        self.positions: list[int] = []
        self._preset: list[tuple[int, Status]] = []   # (position, status) refused up front
        self._repeats: list[tuple[int, int]] = []     # (position, index into keys)
        first_of: dict[bytes, int] = {}
        for position, key in enumerate(keys):
            try:
                raw = to_key(key)
            except KVPoolError as exc:
                self._preset.append((position, exc.status))
                continue
            value = values[position] if values is not None else None
            if values is not None and value is None:
                self._preset.append((position, Status.INVALID_ARGUMENT))
                continue
            first = first_of.setdefault(raw, len(self.keys))
            if first != len(self.keys):
                self._repeats.append((position, first))
                continue
            self.keys.append(raw)
            self.values.append(value)  # type: ignore[arg-type]
            self.positions.append(position)

    @property
    def repeats(self) -> list[tuple[int, int]]:
        """(position, index of the distinct key it repeats) of every later occurrence."""
        return self._repeats

    def refuse(self, index: int, status: Status) -> None:
        """Take distinct key ``index`` out of the batch, failing it (and its repeats) with
        ``status``; indices above it shift down by one."""
        position = self.positions.pop(index)
        self.keys.pop(index)
        self.values.pop(index)
        self._preset.append((position, status))
        kept: list[tuple[int, int]] = []
        for repeat, first in self._repeats:
            if first == index:
                self._preset.append((repeat, status))
            else:
                kept.append((repeat, first - 1 if first > index else first))
        self._repeats = kept

    def spread(self, results: Sequence[Any], failed: Callable[[Status], Any] = lambda s: s
               ) -> list[Any]:
        """Per position of the caller's batch: the result of its distinct key (``results[i]``
        for ``keys[i]``), or ``failed(status)`` where it was refused up front."""
        out: list[Any] = [None] * self.size
        for position, status in self._preset:
            out[position] = failed(status)
        for position, result in zip(self.positions, results, strict=True):
            out[position] = result
        for position, first in self._repeats:
            out[position] = results[first]
        return out
