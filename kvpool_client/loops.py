"""A private event loop on a thread of its own, and the cheap handoff that runs a coroutine
on it from any other thread.

:class:`LoopThread` runs its loop forever on a daemon thread until stopped: the heartbeat's
loop, and the sync client's loop for its start, close, async writes and pipelined commits.
The handoff costs one ``call_soon_threadsafe`` and one raw lock (no ``concurrent.futures
.Future``, whose condition variable costs more). Nothing is tied to the thread that created a
loop: any thread may call.
"""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kvpool_wire.status import KVPoolError, Status

T = TypeVar("T")

#: A handed-over call waiting this long checks whether the loop was closed without taking it.
_CLOSED_CHECK_S = 1.0


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop where uvloop is installed, else the default asyncio loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


async def off_loop(call: Callable[[], T]) -> T:
    """``call()`` on a worker thread, keeping the loop free; on the loop's own thread once the
    interpreter is exiting (its thread pools take no more work then, and a client nobody
    closed must still leave the pool cleanly)."""
    loop = asyncio.get_running_loop()
    try:
        future = loop.run_in_executor(None, call)
    except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
        return call()
    return await future


def _hand_over(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T],
               on_done: Callable[[], None] | None = None) -> T:
    """Run ``coro`` on ``loop``, which another thread runs (or will run), and wait for it.

    Raises ``UNAVAILABLE`` when the loop is closed or the call was cancelled by a shutdown.
    """
    lock = _thread.allocate_lock()
    lock.acquire()
    box: list[asyncio.Task[T]] = []

    def release(_: object) -> None:
        lock.release()
        if on_done is not None:
            on_done()

    def start() -> None:
        task = loop.create_task(coro)
        box.append(task)
        task.add_done_callback(release)

    try:
        loop.call_soon_threadsafe(start)
    except RuntimeError:
        coro.close()
        raise KVPoolError(Status.UNAVAILABLE, "the client is closed") from None
    while not lock.acquire(timeout=_CLOSED_CHECK_S):
        if loop.is_closed() and not box:  # closed before the call was taken
            coro.close()
            raise KVPoolError(Status.UNAVAILABLE, "the client is closed")
    try:
        return box[0].result()
    except asyncio.CancelledError:
        raise KVPoolError(Status.UNAVAILABLE, "the client was closed during the call") from None


def _cancel_tasks(loop: asyncio.AbstractEventLoop) -> None:
    for task in asyncio.all_tasks(loop):
        task.cancel()


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel every task left on the (stopped) loop and let them finish, then close it."""
    for _ in range(3):  # tasks started by callbacks still queued get another round
        with contextlib.suppress(asyncio.CancelledError):  # a queued _cancel_tasks
            loop.run_until_complete(asyncio.sleep(0))  # run the callbacks queued so far
        left = asyncio.all_tasks(loop)
        if not left:
            break
        for task in left:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


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
            _cancel_all(self.loop)

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
        return _hand_over(self.loop, coro)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop and wait for its thread (idempotent)."""
        if self.in_thread:
            raise KVPoolError(Status.INTERNAL_ERROR, "cannot stop a loop from inside it")
        if not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):  # closed between the check and the call
                self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
