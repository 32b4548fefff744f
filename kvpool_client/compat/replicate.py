"""Mooncake's ``ReplicateConfig`` and its translation to kvpool's :class:`PutOptions`.

Engines build it with no arguments and set attributes (MindIE: ``preferred_segment`` = its own
segment name, ``prefer_alloc_in_same_node = True``); the keyword form in INTEGRATIONS.md works
too. Unknown attributes raise ``AttributeError``, as the binding does, so a typo is not silently
ignored.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import Pin, PutOptions


class ReplicateConfig:
    """Placement wishes for one put (Mooncake's names)."""

    __slots__ = ("prefer_alloc_in_same_node", "preferred_segment", "preferred_segments",
                 "replica_num", "with_hard_pin", "with_soft_pin")

    def __init__(self, replica_num: int = 1, preferred_segment: str = "",
                 prefer_alloc_in_same_node: bool = False, with_soft_pin: bool = False,
                 with_hard_pin: bool = False, preferred_segments: list[str] | None = None) -> None:
        self.replica_num = replica_num
        self.preferred_segment = preferred_segment
        self.prefer_alloc_in_same_node = prefer_alloc_in_same_node
        self.with_soft_pin = with_soft_pin
        self.with_hard_pin = with_hard_pin
        self.preferred_segments = list(preferred_segments or [])

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"ReplicateConfig({fields})"


def put_options(config: ReplicateConfig | None,
                segment_id_of: Callable[[str], str]) -> PutOptions | None:
    """Return the PutOptions for ``config`` (None keeps the client's configured defaults).

    ``segment_id_of`` maps a Mooncake segment name (``"host:port"``) to a kvpool segment id.
    Raises ``INVALID_ARGUMENT`` for a config of the wrong type or with a bad attribute.
    """
    if config is None:
        return None
    if not isinstance(config, ReplicateConfig):
        raise KVPoolError(Status.INVALID_ARGUMENT,
                          f"config must be a ReplicateConfig, got {type(config).__name__}")
    replica_num = config.replica_num
    if isinstance(replica_num, bool) or not isinstance(replica_num, int) or replica_num < 1:
        raise KVPoolError(Status.INVALID_ARGUMENT,
                          f"replica_num must be an integer >= 1, got {replica_num!r}")
    preferred = config.preferred_segment or (config.preferred_segments[0]
                                             if config.preferred_segments else "")
    if not isinstance(preferred, str):
        raise KVPoolError(Status.INVALID_ARGUMENT, "preferred_segment must be a string")
    pin = Pin.HARD if config.with_hard_pin else Pin.SOFT if config.with_soft_pin else Pin.NONE
    return PutOptions(replica_num=replica_num, preferred_segment=segment_id_of(preferred),
                      prefer_same_host=bool(config.prefer_alloc_in_same_node), pin=pin)
