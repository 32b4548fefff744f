"""CoreConfig: the tunables of the master core (flags of the same names on kvpool-master)."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool_master.core.eviction import POLICIES
from kvpool_wire.partitions import MAX_PARTITIONS
from kvpool_wire.types import MAX_KEY_BYTES

#: what the pool does with segments a transfer engine reaches (README, "Engine transport"):
#: allow them, refuse them, or require every segment to have one
ENGINE_TRANSPORT_POLICIES = ("allow", "refuse", "require")


@dataclass(frozen=True, slots=True)
class CoreConfig:
    """Tunables of the core; ``ValueError`` naming the field when one is out of range."""

    client_ttl_s: float = 10.0
    default_lease_ttl_s: float = 5.0
    put_start_discard_timeout_s: float = 30.0
    write_capability_ttl_s: float = 10.0  # how long a WRITE capability may be used
    max_segments_per_client: int = 1024
    eviction_high_watermark_ratio: float = 0.95
    eviction_ratio: float = 0.05
    eviction_policy: str = "lru"          # or "prefix-lru"
    max_key_bytes: int = 1024
    max_batch_keys: int = 16_384
    engine_transport: str = "allow"
    ssd_promote_after_hits: int = 1  # reads from SSD only before a DRAM copy is made; 0: never
    copy_task_ttl_s: float = 30.0  # how long a client has for one tier copy it fetched
    # this core is partition ``partition_index`` of ``partition_count`` of the index (README,
    # "Partitions"): it allocates in its share of every segment, numbers leases and copy tasks
    # so that their number names it (``n % partition_count == partition_index``)
    partition_index: int = 0
    partition_count: int = 1

    def __post_init__(self) -> None:
        for name in ("client_ttl_s", "default_lease_ttl_s", "put_start_discard_timeout_s",
                     "write_capability_ttl_s", "copy_task_ttl_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        for name in ("eviction_high_watermark_ratio", "eviction_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")
        if self.eviction_policy not in POLICIES:
            raise ValueError(f"eviction_policy must be one of {POLICIES}, "
                             f"got {self.eviction_policy!r}")
        if not isinstance(self.max_key_bytes, int) or not 0 < self.max_key_bytes <= MAX_KEY_BYTES:
            raise ValueError(f"max_key_bytes must be in [1, {MAX_KEY_BYTES}], "
                             f"got {self.max_key_bytes!r}")
        if not isinstance(self.max_segments_per_client, int) or self.max_segments_per_client < 1:
            raise ValueError(f"max_segments_per_client must be >= 1, "
                             f"got {self.max_segments_per_client!r}")
        if not isinstance(self.max_batch_keys, int) or self.max_batch_keys < 1:
            raise ValueError(f"max_batch_keys must be >= 1, got {self.max_batch_keys!r}")
        if (not isinstance(self.ssd_promote_after_hits, int)
                or isinstance(self.ssd_promote_after_hits, bool)
                or not 0 <= self.ssd_promote_after_hits <= 1_000_000):
            raise ValueError(f"ssd_promote_after_hits must be in [0, 1000000], "
                             f"got {self.ssd_promote_after_hits!r}")
        if (not isinstance(self.partition_count, int) or isinstance(self.partition_count, bool)
                or not 1 <= self.partition_count <= MAX_PARTITIONS):
            raise ValueError(f"partition_count must be in [1, {MAX_PARTITIONS}], "
                             f"got {self.partition_count!r}")
        if (not isinstance(self.partition_index, int) or isinstance(self.partition_index, bool)
                or not 0 <= self.partition_index < self.partition_count):
            raise ValueError(f"partition_index must be in [0, partition_count), "
                             f"got {self.partition_index!r}")
        if self.engine_transport not in ENGINE_TRANSPORT_POLICIES:
            raise ValueError(f"engine_transport must be one of {ENGINE_TRANSPORT_POLICIES}, "
                             f"got {self.engine_transport!r}")

    @property
    def part(self) -> tuple[int, int]:
        """(partition_index, partition_count)."""
        return self.partition_index, self.partition_count
