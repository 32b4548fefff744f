"""KVPoolClient: the synchronous client. It runs :class:`AsyncKVPoolClient` (the one
implementation) on the calling thread: synchronously as far as a call gets without waiting,
then on a private uvloop loop that the calling thread runs when no other thread is running
it; otherwise the call is handed to the thread that runs it (see ``_loopthread.CallerLoop``).

Any thread may call any method at the same time (MindIE puts from a background thread); calls
are served concurrently on the client's loop.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import Any

from kvpool_client._aclient import AsyncKVPoolClient
from kvpool_client._loopthread import CallerLoop
from kvpool_client.buffers import KeyLike
from kvpool_client.config import ClientConfig
from kvpool_client.metrics import ClientMetrics
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import PutOptions

__all__ = ["AsyncKVPoolClient", "ClientConfig", "KVPoolClient"]

logger = logging.getLogger(__name__)


def _close_at_exit(thread: CallerLoop, client: AsyncKVPoolClient) -> None:
    """Best-effort close of a client nobody closed (garbage collection or interpreter exit)."""
    try:
        thread.run(client.close())
    except (KVPoolError, RuntimeError) as exc:
        logger.warning("closing an unclosed kvpool client: %s", exc)
    finally:
        thread.stop()


class KVPoolClient:
    """Synchronous kvpool client; see :class:`AsyncKVPoolClient` for every method's contract."""

    def __init__(self, config: ClientConfig) -> None:
        """Join the pool described by ``config`` (segments created, registered, mounted).

        Raises KVPoolError (RPC_FAILED / TIMEOUT when the master cannot be reached, ...).
        """
        self._thread = CallerLoop("kvpool-client")
        self._client = AsyncKVPoolClient(config)
        self._thread.background_busy = self._client.background_busy
        self._thread.set_direct = self._client.set_direct
        try:
            self._thread.run(self._client.start())
        except BaseException:
            self._thread.stop()
            raise
        self._finalizer = weakref.finalize(self, _close_at_exit, self._thread, self._client)

    @classmethod
    def from_config(cls, path: str | None = None) -> KVPoolClient:
        """A client configured by the JSON file ``path`` (default: the file named by
        KVPOOL_CONFIG_PATH or MOONCAKE_CONFIG_PATH). Raises KVPoolError."""
        return cls(ClientConfig.from_file(path) if path else ClientConfig.from_env())

    def close(self) -> None:
        """Flush async writes, leave the pool and free everything (idempotent). Raises
        KVPoolError when async writes failed (after everything was closed)."""
        if not self._finalizer.alive:
            return
        self._finalizer.detach()
        try:
            self._thread.run(self._client.close())
        finally:
            self._thread.stop()

    def __enter__(self) -> KVPoolClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if exc_info[0] is None:
            self.close()
            return
        try:
            self.close()
        except KVPoolError as exc:  # never mask the exception already in flight
            logger.error("close after an error: %s", exc)

    # -- identity ---------------------------------------------------------------------------------

    @property
    def config(self) -> ClientConfig:
        """The configuration this client runs with."""
        return self._client.config

    @property
    def client_id(self) -> str:
        """This client's id at the master."""
        return self._client.client_id

    @property
    def hostname(self) -> str:
        """``"ip:port"`` of this client's data server."""
        return self._client.hostname

    @property
    def segment_ids(self) -> list[str]:
        """Ids of the segments this client contributes."""
        return self._client.segment_ids

    @property
    def metrics(self) -> ClientMetrics:
        """This client's metrics (``metrics.registry`` is a prometheus CollectorRegistry)."""
        return self._client.metrics

    @property
    def async_client(self) -> AsyncKVPoolClient:
        """The implementation this facade drives (its coroutines run on the private loop)."""
        return self._client

    # -- writes -----------------------------------------------------------------------------------

    def put(self, key: KeyLike, data: Any, *, options: PutOptions | None = None,
            async_write: bool = False) -> None:
        """See AsyncKVPoolClient.put."""
        self._thread.run(self._client.put(key, data, options=options, async_write=async_write))

    def put_from(self, key: KeyLike, buf: Any, offset: int, size: int, *,
                 options: PutOptions | None = None, async_write: bool = False) -> None:
        """See AsyncKVPoolClient.put_from."""
        self._thread.run(self._client.put_from(key, buf, offset, size, options=options,
                                               async_write=async_write))

    def put_batch(self, keys: Sequence[KeyLike], datas: Sequence[Any], *,
                  options: PutOptions | None = None, async_write: bool = False) -> list[Status]:
        """See AsyncKVPoolClient.put_batch."""
        return self._thread.run(self._client.put_batch(keys, datas, options=options,
                                                       async_write=async_write))

    def batch_put_from(self, keys: Sequence[KeyLike], bufs: Any, offsets: Sequence[int],
                       sizes: Sequence[int], *, options: PutOptions | None = None,
                       async_write: bool = False) -> list[Status]:
        """See AsyncKVPoolClient.batch_put_from."""
        return self._thread.run(self._client.batch_put_from(keys, bufs, offsets, sizes,
                                                            options=options,
                                                            async_write=async_write))

    def batch_put_regions(self, keys: Sequence[KeyLike], regions: Sequence[Sequence[Any]],
                          options: PutOptions | None = None,
                          async_write: bool = False) -> list[Status]:
        """See AsyncKVPoolClient.batch_put_regions."""
        return self._thread.run(self._client.batch_put_regions(keys, regions, options,
                                                               async_write))

    def batch_put_with(self, keys: Sequence[KeyLike], sizes: Sequence[int], fill: Any,
                       options: PutOptions | None = None, done: Any = None) -> list[Status]:
        """See AsyncKVPoolClient.batch_put_with."""
        return self._thread.run(self._client.batch_put_with(keys, sizes, fill, options, done))

    def batch_get_with(self, keys: Sequence[KeyLike], consume: Any,
                       done: Any = None) -> list[int]:
        """See AsyncKVPoolClient.batch_get_with."""
        return self._thread.run(self._client.batch_get_with(keys, consume, done))

    def pin_shared_memory(self, pin: Any, unpin: Any) -> None:
        """See AsyncKVPoolClient.pin_shared_memory."""
        self._thread.run(self._pin(pin, unpin))

    async def _pin(self, pin: Any, unpin: Any) -> None:
        self._client.pin_shared_memory(pin, unpin)

    # -- reads ------------------------------------------------------------------------------------

    def get(self, key: KeyLike) -> bytes | None:
        """See AsyncKVPoolClient.get."""
        return self._thread.run(self._client.get(key))

    def get_into(self, key: KeyLike, buf: Any, offset: int, size: int) -> int:
        """See AsyncKVPoolClient.get_into."""
        return self._thread.run(self._client.get_into(key, buf, offset, size))

    def get_batch(self, keys: Sequence[KeyLike]) -> list[bytes | None]:
        """See AsyncKVPoolClient.get_batch."""
        return self._thread.run(self._client.get_batch(keys))

    def batch_get_into(self, keys: Sequence[KeyLike], bufs: Any, offsets: Sequence[int],
                       sizes: Sequence[int]) -> list[int]:
        """See AsyncKVPoolClient.batch_get_into."""
        return self._thread.run(self._client.batch_get_into(keys, bufs, offsets, sizes))

    def batch_get_regions(self, keys: Sequence[KeyLike],
                          regions: Sequence[Sequence[Any]]) -> list[int]:
        """See AsyncKVPoolClient.batch_get_regions."""
        return self._thread.run(self._client.batch_get_regions(keys, regions))

    # -- lookups and removal ----------------------------------------------------------------------

    def exists(self, key: KeyLike) -> bool:
        """See AsyncKVPoolClient.exists."""
        return self._thread.run(self._client.exists(key))

    def batch_exists(self, keys: Sequence[KeyLike]) -> list[bool]:
        """See AsyncKVPoolClient.batch_exists."""
        return self._thread.run(self._client.batch_exists(keys))

    def get_size(self, key: KeyLike) -> int | None:
        """See AsyncKVPoolClient.get_size."""
        return self._thread.run(self._client.get_size(key))

    def query_prefix(self, keys: Sequence[KeyLike]) -> int:
        """See AsyncKVPoolClient.query_prefix."""
        return self._thread.run(self._client.query_prefix(keys))

    def remove(self, key: KeyLike, force: bool = False) -> None:
        """See AsyncKVPoolClient.remove."""
        self._thread.run(self._client.remove(key, force))

    def batch_remove(self, keys: Sequence[KeyLike], force: bool = False) -> list[Status]:
        """See AsyncKVPoolClient.batch_remove."""
        return self._thread.run(self._client.batch_remove(keys, force))

    def remove_all(self, force: bool = False) -> int:
        """See AsyncKVPoolClient.remove_all."""
        return self._thread.run(self._client.remove_all(force))

    def remove_by_regex(self, pattern: str, force: bool = False) -> int:
        """See AsyncKVPoolClient.remove_by_regex."""
        return self._thread.run(self._client.remove_by_regex(pattern, force))

    # -- buffers, async writes, metrics -----------------------------------------------------------

    def register_buffer(self, buf: Any) -> None:
        """See AsyncKVPoolClient.register_buffer (no loop round trip needed)."""
        self._client.buffers.register(buf)

    def unregister_buffer(self, buf: Any) -> None:
        """See AsyncKVPoolClient.unregister_buffer."""
        self._client.buffers.unregister(buf)

    def flush(self, timeout_s: float | None = None) -> None:
        """See AsyncKVPoolClient.flush."""
        self._thread.run(self._client.flush(timeout_s))

    def start_metrics_server(self, port: int, host: str = "127.0.0.1") -> int:
        """See AsyncKVPoolClient.start_metrics_server."""
        return self._thread.run(self._client.start_metrics_server(port, host))
