"""``mooncake.store``: Mooncake Store's client classes, backed by kvpool."""

from kvpool_client.compat.store_surface import *  # noqa: F403 (the whole surface, by name)
from kvpool_client.compat.store_surface import __all__  # noqa: F401
