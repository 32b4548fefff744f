"""kvpool's drop-in ``mooncake`` package: ``mooncake.store`` and ``mooncake.engine`` over kvpool.

Installed in place of Mooncake's wheel (both own the top-level name ``mooncake``). To keep the
wheel and serve only ``mooncake.store`` from kvpool, install ``kvpool-mooncake-store``
(``compat/mooncake-store``) beside it instead.
"""

BACKEND = "kvpool"
