"""kvpool's drop-in ``mooncake`` package: ``mooncake.store`` and ``mooncake.engine`` over kvpool.

Installed in place of Mooncake's wheel (the two cannot be installed together: both own the
top-level name ``mooncake``).
"""

BACKEND = "kvpool"
