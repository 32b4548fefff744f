"""What the partitions of a partitioned master share, and where each keeps its state
(README, "Partitions").

Rules of this file:
- Partition 0 (the process an operator starts) draws the terms once per start and hands
  them to the partitions it starts: the secret that signs join tickets
  (``kvpool_wire.partitions``), one capability epoch and one capability clock origin (a
  ``time.monotonic`` instant, which every process of the host shares), so that a client's
  data server checks the capabilities of every partition against one clock.
- With several partitions, partition i keeps its state in ``<state-dir>/partition-<i>``, and
  ``<state-dir>/partitions`` names their count: a state directory is only ever opened with
  the count it was written with (a key's partition depends on it).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from kvpool_wire.partitions import SECRET_BYTES

COUNT_FILE = "partitions"


@dataclass(frozen=True, slots=True)
class PartitionTerms:
    """This process's partition and what all partitions share."""

    index: int = 0
    count: int = 1
    secret: bytes = b""
    epoch: int = 0
    clock_origin_s: float = 0.0

    @classmethod
    def drawn(cls, count: int) -> list[PartitionTerms]:
        """Fresh terms for each of ``count`` partitions (at a start of partition 0)."""
        secret = os.urandom(SECRET_BYTES)
        epoch = int.from_bytes(os.urandom(8), "little") >> 1
        origin_s = time.monotonic()
        return [cls(index, count, secret, epoch, origin_s) for index in range(count)]


#: A master of one process.
SOLE = PartitionTerms()


class StateLayoutError(ValueError):
    """The state directory holds an index split another way than this start asks."""


def state_dir_of(state_dir: str, terms: PartitionTerms) -> str:
    """Where partition ``terms.index`` keeps its state ("" without a state directory)."""
    if not state_dir or terms.count == 1:
        return state_dir
    return str(Path(state_dir) / f"partition-{terms.index}")


#: What a state directory may hold besides an index (a fresh ext4 volume's lost+found).
_NOT_AN_INDEX = frozenset({"lost+found"})


def claim_state_dir(state_dir: str, count: int) -> None:
    """Check that ``state_dir`` holds nothing, or an index of ``count`` partitions, and note
    the count in it; raise StateLayoutError otherwise."""
    if not state_dir:
        return
    root = Path(state_dir)
    marker = root / COUNT_FILE
    unfinished = marker.with_name(COUNT_FILE + ".tmp")   # a start cut short before its rename
    try:
        written = int(marker.read_text().strip())
    except FileNotFoundError:
        held = root.is_dir() and any(path != unfinished and path.name not in _NOT_AN_INDEX
                                     for path in root.iterdir())
        written = 0 if count > 1 and held else -1
    except (OSError, ValueError) as exc:
        raise StateLayoutError(f"cannot read {marker}: {exc}") from None
    if written == 0:
        raise StateLayoutError(f"{state_dir} holds the index of a master of one process: "
                               "start it without --partitions, or use another state directory")
    if written > 0 and written != count:
        raise StateLayoutError(f"{state_dir} holds an index split in {written} partitions: "
                               f"start with --partitions {written}, or use another state "
                               "directory")
    if count > 1 and written < 0:
        root.mkdir(parents=True, exist_ok=True)
        with open(unfinished, "w") as f:
            f.write(f"{count}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(unfinished, marker)
        directory = os.open(root, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
