"""Mooncake's ``ReplicateConfig`` and ``SoftPinAction``, and their translation to kvpool's
:class:`PutOptions`.

Engines build it with no arguments and set attributes (MindIE: ``preferred_segment`` = its own
segment name, ``prefer_alloc_in_same_node = True``); the keyword form
(``ReplicateConfig(replica_num=2)``) works too. The fields are those Mooncake 0.3.13 binds;
unknown attributes raise ``AttributeError``, as the binding does, so a typo is not silently
ignored.

- ``soft_pin_action``: ENABLE soft-pins the object, DISABLE and PRESERVE (the default) do not
  (kvpool objects are write-once: there is no earlier pin to preserve). ``with_soft_pin`` (the
  older spelling) reads and sets it.
- ``soft_pin_ttl_ms`` is None or an unsigned 64-bit integer (else ``TypeError``, as the binding's
  conversion). It is accepted only with ``SoftPinAction.ENABLE``: a put with it set and another
  action answers -600, as Mooncake does; kvpool keeps a soft pin until eviction needs its space.
- ``nof_replica_num``, ``dfs_replica_num``, ``preferred_nof_segments``, ``data_type`` (an
  ``ObjectDataType``; anything else is ``TypeError``, as the binding) and ``group_ids`` (tiers
  and groups kvpool does not have) are kept and ignored.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from kvpool_client.compat.store_types import ObjectDataType
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import Pin, PutOptions

_U64_LIMIT = 1 << 64


class SoftPinAction(enum.IntEnum):
    """What a put does to the object's soft pin (Mooncake's values)."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ReplicateConfig:
    """Placement wishes for one put (Mooncake's names)."""

    __slots__ = ("prefer_alloc_in_same_node", "preferred_segment", "preferred_segments",
                 "replica_num", "with_hard_pin", "soft_pin_action", "_soft_pin_ttl_ms",
                 "nof_replica_num", "dfs_replica_num", "preferred_nof_segments", "_data_type",
                 "group_ids")

    def __init__(self, replica_num: int = 1, preferred_segment: str = "",
                 prefer_alloc_in_same_node: bool = False, with_soft_pin: bool = False,
                 with_hard_pin: bool = False, preferred_segments: list[str] | None = None,
                 soft_pin_action: SoftPinAction = SoftPinAction.PRESERVE,
                 soft_pin_ttl_ms: int | None = None) -> None:
        self.replica_num = replica_num
        self.preferred_segment = preferred_segment
        self.prefer_alloc_in_same_node = prefer_alloc_in_same_node
        self.with_hard_pin = with_hard_pin
        self.preferred_segments = list(preferred_segments or [])
        self.soft_pin_action = SoftPinAction.ENABLE if with_soft_pin else soft_pin_action
        self.soft_pin_ttl_ms = soft_pin_ttl_ms
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.preferred_nof_segments: list[str] = []
        self.data_type = ObjectDataType.UNKNOWN
        self.group_ids: list[str] = []

    @property
    def soft_pin_ttl_ms(self) -> int | None:
        """How long a soft pin should last (None: the master's default)."""
        return self._soft_pin_ttl_ms

    @soft_pin_ttl_ms.setter
    def soft_pin_ttl_ms(self, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 0 <= value < _U64_LIMIT):
            raise TypeError(f"soft_pin_ttl_ms must be None or an unsigned 64-bit integer, "
                            f"got {value!r}")
        self._soft_pin_ttl_ms = value

    @property
    def data_type(self) -> ObjectDataType:
        """What the object holds (kept, not used by kvpool)."""
        return self._data_type

    @data_type.setter
    def data_type(self, value: ObjectDataType) -> None:
        if not isinstance(value, ObjectDataType):
            raise TypeError(f"data_type must be an ObjectDataType, got {type(value).__name__}")
        self._data_type = value

    @property
    def with_soft_pin(self) -> bool:
        """The older spelling of ``soft_pin_action == SoftPinAction.ENABLE``."""
        return bool(self.soft_pin_action == SoftPinAction.ENABLE)

    @with_soft_pin.setter
    def with_soft_pin(self, value: bool) -> None:
        self.soft_pin_action = SoftPinAction.ENABLE if value else SoftPinAction.PRESERVE

    def __repr__(self) -> str:
        fields = ", ".join(f"{name.lstrip('_')}={getattr(self, name)!r}"
                           for name in self.__slots__)
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
    try:
        action = SoftPinAction(config.soft_pin_action)
    except ValueError:
        raise KVPoolError(Status.INVALID_ARGUMENT, "soft_pin_action must be a SoftPinAction, "
                          f"got {config.soft_pin_action!r}") from None
    if config.soft_pin_ttl_ms is not None and action != SoftPinAction.ENABLE:
        raise KVPoolError(Status.INVALID_ARGUMENT,
                          "soft_pin_ttl_ms is only valid with SoftPinAction.ENABLE")
    pin = Pin.HARD if config.with_hard_pin else \
        Pin.SOFT if action == SoftPinAction.ENABLE else Pin.NONE
    return PutOptions(replica_num=replica_num, preferred_segment=segment_id_of(preferred),
                      prefer_same_host=bool(config.prefer_alloc_in_same_node), pin=pin)
