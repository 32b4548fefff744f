"""``mooncake.store``: Mooncake Store's client classes, backed by kvpool."""

from kvpool_client.compat.mooncake import (
    BufferHandle,
    MooncakeDistributedStore,
    ReplicateConfig,
    SoftPinAction,
)

__all__ = ["BufferHandle", "MooncakeDistributedStore", "ReplicateConfig", "SoftPinAction"]
