"""Helper processes for the reliability tests: a real KVPoolClient in its own process.

``python _workers.py put_loop CONFIG_JSON PREFIX SIZE BATCH SEGMENT``: see :func:`put_loop`.
``python _workers.py soak CONFIG_JSON DURATION_S SEED WORKER`` runs a mixed put/get/remove loop
for DURATION_S seconds and prints one JSON line of counts. Every value stored under a key is
:func:`payload` (derived from the key), so every read is checked by an xxhash checksum.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any

import numpy as np
import xxhash


def payload(key: str, size_bytes: int) -> bytes:
    """The bytes stored under ``key``: pseudo-random, seeded by the key's xxh64."""
    rng = np.random.default_rng(xxhash.xxh64_intdigest(key.encode()))
    return rng.integers(0, 256, size_bytes, dtype=np.uint8).tobytes()


def size_of(key: str, low: int = 16 << 10, high: int = 256 << 10) -> int:
    """The size of ``key``'s value, derived from the key so any process knows it."""
    return low + xxhash.xxh32_intdigest(key.encode()) % (high - low)


def soak(config: dict[str, Any], duration_s: float, seed: int, worker: int,
         workers: int) -> dict[str, Any]:
    """Mixed puts, gets (own and other workers' keys) and removes until ``duration_s``."""
    from kvpool_client.client import KVPoolClient
    from kvpool_client.config import ClientConfig
    from kvpool_wire.status import KVPoolError, Status

    rng = random.Random(seed)
    counts = {"puts": 0, "put_failed": 0, "gets": 0, "hits": 0, "misses": 0, "mismatches": 0,
              "removes": 0, "errors": 0, "bytes_put": 0, "bytes_read": 0}
    next_index = 0
    deadline = time.monotonic() + duration_s
    with KVPoolClient(ClientConfig.from_dict(config)) as client:
        while time.monotonic() < deadline:
            roll = rng.random()
            try:
                if roll < 0.45:
                    keys = [f"w{worker}-{next_index + i}" for i in range(rng.randint(1, 4))]
                    next_index += len(keys)
                    datas = [payload(k, size_of(k)) for k in keys]
                    statuses = client.put_batch(keys, datas)
                    for data, status in zip(datas, statuses, strict=True):
                        if status in (Status.OK, Status.ALREADY_EXISTS):
                            counts["puts"] += 1
                            counts["bytes_put"] += len(data)
                        else:
                            counts["put_failed"] += 1
                            refused = counts.setdefault("refused_statuses", {})
                            refused[status.name] = refused.get(status.name, 0) + 1
                elif roll < 0.90 and next_index:
                    owner = rng.randrange(workers)
                    # recent keys mostly (they may still be cached), any key sometimes
                    keys = [f"w{owner}-{max(0, next_index - 1 - rng.randrange(300))}"
                            if rng.random() < 0.8 else f"w{owner}-{rng.randrange(next_index)}"
                            for _ in range(rng.randint(1, 4))]
                    for key, value in zip(keys, client.get_batch(keys), strict=True):
                        counts["gets"] += 1
                        if value is None:
                            counts["misses"] += 1
                            continue
                        counts["hits"] += 1
                        counts["bytes_read"] += len(value)
                        expected = payload(key, size_of(key))
                        if xxhash.xxh3_64_intdigest(value) != xxhash.xxh3_64_intdigest(expected):
                            counts["mismatches"] += 1
                elif next_index:
                    key = f"w{worker}-{rng.randrange(next_index)}"
                    client.batch_remove([key])
                    counts["removes"] += 1
            except KVPoolError as exc:
                counts["errors"] += 1
                counts.setdefault("error_statuses", {})
                name = exc.status.name
                counts["error_statuses"][name] = counts["error_statuses"].get(name, 0) + 1
    return counts


def put_loop(config: dict[str, Any], prefix: str, size_bytes: int, batch: int,
             segment: str) -> None:
    """Put one object on its own segment, print ``{"ready": ...}``, then put batches of
    ``batch`` objects into ``segment`` until killed, printing ``{"batch": n}`` after each."""
    from kvpool_client.client import KVPoolClient
    from kvpool_client.config import ClientConfig
    from kvpool_wire.types import PutOptions

    client = KVPoolClient(ClientConfig.from_dict(config))
    own = client.segment_ids[0]
    client.put("own-0", payload("own-0", 4096), options=PutOptions(preferred_segment=own))
    print(json.dumps({"ready": True, "client_id": client.client_id, "segment_id": own}),
          flush=True)
    options = PutOptions(preferred_segment=segment)
    for n in range(100_000):
        keys = [f"{prefix}-{n}-{i}" for i in range(batch)]
        statuses = client.put_batch(keys, [payload(k, size_bytes) for k in keys],
                                    options=options)
        print(json.dumps({"batch": n, "statuses": [s.name for s in statuses]}), flush=True)
    client.close()


def main(argv: list[str]) -> None:
    if argv[1] == "put_loop":
        put_loop(json.loads(argv[2]), argv[3], int(argv[4]), int(argv[5]), argv[6])
    elif argv[1] == "soak":
        config = json.loads(argv[2])
        result = soak(config, float(argv[3]), int(argv[4]), int(argv[5]), int(argv[6]))
        result["pid"] = os.getpid()
        print(json.dumps(result), flush=True)
    else:
        raise SystemExit(f"unknown command {argv[1]!r}")


if __name__ == "__main__":
    main(sys.argv)
