"""Mooncake-compatible surfaces over kvpool.

``kvpool_client.compat.mooncake`` offers ``MooncakeDistributedStore``, ``ReplicateConfig`` and
``TransferEngine`` with Mooncake Store's calls and integer return codes; the drop-in package in
``compat/mooncake/`` re-exports them as ``mooncake.store`` and ``mooncake.engine``.
"""
