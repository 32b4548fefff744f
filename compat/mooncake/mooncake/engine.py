"""``mooncake.engine``: the TransferEngine facade engines create before ``setup``."""

from kvpool_client.compat.engine import TransferEngine

__all__ = ["TransferEngine"]
