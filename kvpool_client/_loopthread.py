"""A private event loop on its own thread, and the cheap handoff that runs coroutines on it.

The sync client and the heartbeat both use one. The handoff costs one ``call_soon_threadsafe``
and one raw lock (no ``concurrent.futures.Future``, whose condition variable costs more), and
any thread may call it: nothing is tied to the thread that created the loop.
"""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from kvpool_client.status import KVPoolError, Status

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop where uvloop is installed, else the default asyncio loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


class LoopThread:
    """An event loop running forever on a daemon thread until :meth:`stop`."""

    def __init__(self, name: str) -> None:
        self.loop = new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._started.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        try:
            self.loop.run_forever()
        finally:
            # Calls still waiting in run() must wake up: cancel what is left and let it finish.
            left = asyncio.all_tasks(self.loop)
            for task in left:
                task.cancel()
            if left:
                self.loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    @property
    def in_thread(self) -> bool:
        """True when called from the loop's own thread."""
        return threading.get_ident() == self._thread.ident

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and return its result (or raise its exception).

        Raises ``UNAVAILABLE`` when the loop is stopped, ``INTERNAL_ERROR`` when called from the
        loop's own thread (that would deadlock).
        """
        if self.in_thread:
            coro.close()
            raise KVPoolError(Status.INTERNAL_ERROR,
                              "a blocking client call was made from the client's own loop thread")
        lock = _thread.allocate_lock()
        lock.acquire()
        box: list[asyncio.Task[T]] = []

        def release(_: object) -> None:
            lock.release()

        def start() -> None:
            task = self.loop.create_task(coro)
            box.append(task)
            task.add_done_callback(release)

        try:
            self.loop.call_soon_threadsafe(start)
        except RuntimeError:
            coro.close()
            raise KVPoolError(Status.UNAVAILABLE, "the client is closed") from None
        lock.acquire()
        try:
            return box[0].result()
        except asyncio.CancelledError:
            raise KVPoolError(Status.UNAVAILABLE, "the client was closed during the call") from None

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop and wait for its thread (idempotent)."""
        if self.in_thread:
            raise KVPoolError(Status.INTERNAL_ERROR, "cannot stop a loop from inside it")
        if not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):  # closed between the check and the call
                self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
