"""The enums and small types ``mooncake.store`` binds beside its store class (Mooncake 0.3.13),
so code that imports or builds them runs on the drop-in.

Rules of this file:
- Enums carry Mooncake's names and numbers (``ObjectDataType.KVCACHE == 1``, ...); each member
  is also a module-level name, as the binding exports them.
- Plain value types (``ParallelAxis``, ``TensorParallelism``, ``ReadTarget``, ``Descriptor``,
  ``QueryTaskResponse``, ``EngramStoreConfig``) have Mooncake's fields and defaults; a field of
  the wrong type raises ``TypeError`` and an unknown attribute ``AttributeError``, as the
  binding does.
- Types of features kvpool does not have (Engram stores, NoF registration) exist and refuse
  construction with ``NotImplementedError`` naming the feature (the buffer pool and the host
  allocator are in ``host_memory.py``). Descriptors are handed out by ``get_replica_desc``
  and have no public constructor, as in Mooncake.
- ``bind_to_numa_node(node)`` pins the calling thread to that node's CPUs.
"""

from __future__ import annotations

import enum
import os
from typing import Any


class ObjectDataType(enum.IntEnum):
    """What an object holds (``ReplicateConfig.data_type``)."""

    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


class ReplicaStatus(enum.IntEnum):
    """The state of one replica."""

    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class TaskType(enum.IntEnum):
    """Kinds of replica tasks."""

    REPLICA_COPY = 0
    REPLICA_MOVE = 1


class TaskStatus(enum.IntEnum):
    """States of a replica task."""

    PENDING = 0
    PROCESSING = 1
    FAILED = 2
    SUCCESS = 3


def _checked(name: str, value: Any, kinds: tuple[type, ...], optional: bool = False) -> Any:
    if (value is None and optional) or (isinstance(value, kinds)
                                        and not (isinstance(value, bool) and bool not in kinds)):
        return value
    wanted = " or ".join(k.__name__ for k in kinds) + (" or None" if optional else "")
    raise TypeError(f"{name} must be {wanted}, got {type(value).__name__}")


class _Value:
    """Fields with defaults and checked types (``_FIELDS``: name -> (default, kinds, optional))."""

    _FIELDS: dict[str, tuple[Any, tuple[type, ...], bool]] = {}
    __slots__ = ("_values",)

    def __init__(self) -> None:
        object.__setattr__(self, "_values", {
            name: list(default) if isinstance(default, list) else default
            for name, (default, _, _) in self._FIELDS.items()})

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        field = self._FIELDS.get(name)
        if field is None:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        self._values[name] = _checked(f"{type(self).__name__}.{name}", value, field[1], field[2])

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={value!r}" for name, value in self._values.items())
        return f"{type(self).__name__}({fields})"


class ParallelAxis(_Value):
    """One axis of a tensor's parallel layout."""

    _FIELDS = {"kind": ("", (str,), False), "rank": (0, (int,), False),
               "size": (1, (int,), False), "split_dim": (None, (int,), True),
               "expert_id": (None, (int,), True), "stage_id": (None, (int,), True)}
    __slots__ = ()


class TensorParallelism(_Value):
    """A tensor's parallel layout: its axes."""

    _FIELDS = {"axes": ([], (list,), False)}
    __slots__ = ()


class ReadTarget(_Value):
    """How a read wants a tensor: as stored, one shard, or whole."""

    _FIELDS = {"mode": ("as_stored", (str,), False),
               "parallelism": (None, (TensorParallelism,), True)}
    __slots__ = ()
    MODES = ("as_stored", "shard", "full")

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "mode" and isinstance(value, str):
            if value.lower() not in self.MODES:
                raise RuntimeError(f"Unsupported ReadTarget mode: {value.upper()}")
            value = value.lower()
        super().__setattr__(name, value)


class Descriptor(_Value):
    """Where a buffer lies: its address, size and transport endpoint."""

    _FIELDS = {"buffer_address": (0, (int,), False), "size": (0, (int,), False),
               "transport_endpoint": ("", (str,), False)}
    __slots__ = ()


class QueryTaskResponse(_Value):
    """The state of one replica task."""

    _FIELDS = {"id": ((0, 0), (tuple,), False), "type": (TaskType.REPLICA_COPY, (TaskType,),
                                                          False),
               "status": (TaskStatus.PENDING, (TaskStatus,), False),
               "created_at_ms_epoch": (0, (int,), False),
               "last_updated_at_ms_epoch": (0, (int,), False),
               "assigned_client": ((0, 0), (tuple,), False), "message": ("", (str,), False)}
    __slots__ = ()


class EngramStoreConfig(_Value):
    """The shape of an Engram store's tables."""

    _FIELDS = {"embedding_dim": (64, (int,), False), "table_vocab_sizes": ([1024], (list,), False)}
    __slots__ = ()


def _no_constructor(name: str) -> type:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> None:
        raise TypeError(f"mooncake.store.{name}: No constructor defined!")
    return type(name, (), {"__init__": refuse, "__doc__": f"Mooncake's ``{name}`` (handed out "
                                                          "by replica queries only)."})


def _not_in_kvpool(name: str, feature: str) -> type:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"mooncake.store.{name}: {feature} is not supported by kvpool")
    return type(name, (), {"__init__": refuse, "__doc__": f"Mooncake's ``{name}``: {feature}, "
                                                          "which kvpool does not have."})


class MemoryDescriptor:
    """Where a memory replica lies (``buffer_descriptor``); handed out, never built."""

    __slots__ = ("buffer_descriptor",)
    buffer_descriptor: Descriptor

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("mooncake.store.MemoryDescriptor: No constructor defined!")


class ReplicaDescriptor:
    """One replica of an object, as ``get_replica_desc`` hands it out. kvpool keeps objects in
    memory segments only: every replica is a COMPLETE memory replica whose buffer descriptor
    gives its offset in its segment (kvpool has no global addresses), its length, and the
    owner's data-server endpoint."""

    __slots__ = ("status", "_memory")
    status: ReplicaStatus
    _memory: MemoryDescriptor

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("mooncake.store.ReplicaDescriptor: No constructor defined!")

    @classmethod
    def in_memory(cls, offset: int, length: int, endpoint: str) -> ReplicaDescriptor:
        """The descriptor of a committed replica of ``length`` bytes at ``offset``."""
        buffer = Descriptor()
        buffer.buffer_address, buffer.size, buffer.transport_endpoint = offset, length, endpoint
        memory = object.__new__(MemoryDescriptor)
        memory.buffer_descriptor = buffer
        replica = object.__new__(cls)
        replica.status = ReplicaStatus.COMPLETE
        replica._memory = memory
        return replica

    def is_memory_replica(self) -> bool:
        return True

    def is_disk_replica(self) -> bool:
        return False

    def is_local_disk_replica(self) -> bool:
        return False

    def get_memory_descriptor(self) -> MemoryDescriptor:
        return self._memory

    def get_disk_descriptor(self) -> Any:
        raise RuntimeError("Expected DiskDescriptor")


DiskDescriptor = _no_constructor("DiskDescriptor")
BufferLeaseView = _no_constructor("BufferLeaseView")   # host_memory.BufferLease.buffer's
EngramStore = _not_in_kvpool("EngramStore", "the Engram embedding store")
MooncakeDistributedNoFRegister = _not_in_kvpool("MooncakeDistributedNoFRegister",
                                                "NVMe-oF segment registration")


def bind_to_numa_node(node: int) -> None:
    """Pin the calling thread to the CPUs of NUMA node ``node``. Raises ``ValueError`` for a
    node this host does not have."""
    try:
        with open(f"/sys/devices/system/node/node{int(node)}/cpulist", encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        raise ValueError(f"NUMA node {node} does not exist on this host") from None
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    os.sched_setaffinity(0, cpus)


#: Every enum member is also a module-level name in ``mooncake.store``.
ENUM_MEMBERS: dict[str, enum.IntEnum] = {
    member.name: member
    for cls in (ObjectDataType, ReplicaStatus, TaskType, TaskStatus)
    for member in cls
}
