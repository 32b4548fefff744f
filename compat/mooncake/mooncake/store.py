"""``mooncake.store``: Mooncake Store's client classes, backed by kvpool."""

from kvpool_client.compat.mooncake import MooncakeDistributedStore, ReplicateConfig

__all__ = ["MooncakeDistributedStore", "ReplicateConfig"]
