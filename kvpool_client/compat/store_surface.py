"""The names of ``mooncake.store`` (Mooncake Store's client classes), backed by kvpool.

It is the module ``mooncake.store`` of both drop-ins: ``kvpool-mooncake`` (the whole
``mooncake`` package, where Mooncake's wheel is not installed) re-exports it, and
``kvpool-mooncake-store`` (beside Mooncake's wheel) loads it under that name.
"""

from kvpool_client.compat.mooncake import (
    BufferHandle,
    MooncakeDistributedStore,
    ReplicateConfig,
    SoftPinAction,
)
from kvpool_client.compat.store_types import ENUM_MEMBERS as _ENUM_MEMBERS
from kvpool_client.compat.store_types import (
    BufferLease,
    BufferLeaseView,
    BufferPool,
    Descriptor,
    DiskDescriptor,
    EngramStore,
    EngramStoreConfig,
    MemoryDescriptor,
    MooncakeDistributedNoFRegister,
    MooncakeHostMemAllocator,
    ObjectDataType,
    ParallelAxis,
    QueryTaskResponse,
    ReadTarget,
    RegisteredBufferLease,
    RegisteredBufferLeaseView,
    RegisteredBufferPool,
    ReplicaDescriptor,
    ReplicaStatus,
    TaskStatus,
    TaskType,
    TensorParallelism,
    bind_to_numa_node,
    get_alloc_func_addr,
    get_free_func_addr,
)

globals().update(_ENUM_MEMBERS)  # Mooncake exports every enum member by name too

__all__ = [
    "BufferHandle", "BufferLease", "BufferLeaseView", "BufferPool", "Descriptor",
    "DiskDescriptor", "EngramStore", "EngramStoreConfig", "MemoryDescriptor",
    "MooncakeDistributedNoFRegister", "MooncakeDistributedStore", "MooncakeHostMemAllocator",
    "ObjectDataType", "ParallelAxis", "QueryTaskResponse", "ReadTarget", "RegisteredBufferLease",
    "RegisteredBufferLeaseView", "RegisteredBufferPool", "ReplicaDescriptor", "ReplicaStatus",
    "ReplicateConfig", "SoftPinAction", "TaskStatus", "TaskType", "TensorParallelism",
    "bind_to_numa_node", "get_alloc_func_addr", "get_free_func_addr", *_ENUM_MEMBERS,
]

BACKEND = "kvpool"
