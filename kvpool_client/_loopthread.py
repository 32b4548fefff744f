"""Private event loops for the synchronous client and the heartbeat, and the cheap handoff
that runs a coroutine on a loop another thread is running.

- :class:`LoopThread`: a loop running forever on its own daemon thread (the heartbeat).
- :class:`CallerLoop`: the sync client's loop. When no other thread is running it, a blocking
  call runs *on the calling thread*: first synchronously, stepping the coroutine by hand as
  far as it gets without waiting (``set_direct`` lets the client's master calls block the
  thread meanwhile), so a single put or get never enters the loop at all; a coroutine that
  has to wait continues in a task of the loop, run on the same thread. Measured on 2 cores:
  a loop run costs 5 µs on a worker thread and 25–30 µs on the main thread (uvloop sets up
  signal wake-ups on every run there), a handoff to a loop thread 55–62 µs. When the loop
  is busy elsewhere (concurrent callers, a caller inside its own event loop), the call is
  handed to whoever runs it. A helper thread runs the loop only while work is left for the
  background (handed-over calls, async writes, pipelined commits), then lets callers borrow
  it again.

Code that a :class:`CallerLoop` runs must not need a current task in its synchronous stretch
(``asyncio.timeout``, and ``asyncio.wait_for`` since Python 3.12, do): the client uses
:func:`wait_for` from here instead (a test keeps it so).

The handoff costs one ``call_soon_threadsafe`` and one raw lock (no ``concurrent.futures
.Future``, whose condition variable costs more). Nothing is tied to the thread that created a
loop: any thread may call.
"""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any, TypeVar, cast

from kvpool_wire.status import KVPoolError, Status

T = TypeVar("T")

#: While background work is left, the helper thread re-checks it this often.
BACKGROUND_POLL_S = 0.001
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


class _Resumed:
    """Awaitable that continues a coroutine which already yielded ``waiting_for`` (what it
    waits on, e.g. a future of the loop) when it was stepped by hand, as if a task had run it
    from the start."""

    def __init__(self, coro: Coroutine[Any, Any, Any], waiting_for: Any) -> None:
        self._coro = coro
        self._waiting_for = waiting_for

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, waiting_for = self._coro, self._waiting_for
        while True:
            try:
                sent = yield waiting_for
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # thrown in by the task (cancellation): pass it on
                try:
                    waiting_for = coro.throw(exc)
                except StopIteration as finished:
                    return finished.value
            else:
                try:
                    waiting_for = coro.send(sent)
                except StopIteration as finished:
                    return finished.value


async def _resume(coro: Coroutine[Any, Any, T], waiting_for: Any) -> T:
    return cast(T, await _Resumed(coro, waiting_for))


async def wait_for(awaitable: Awaitable[T], timeout_s: float | None) -> T:
    """``asyncio.wait_for`` that also works in the stretch of a call that a :class:`CallerLoop`
    runs on the calling thread, where no task is current (Python 3.12's ``wait_for`` needs one).

    Raises TimeoutError after ``timeout_s`` (None: no limit); the awaitable is cancelled and
    waited for first.
    """
    future = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait(
            [future], timeout=None if timeout_s is None else max(timeout_s, 0.0))
    except asyncio.CancelledError:
        future.cancel()
        raise
    if not done:
        future.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await future
        raise TimeoutError
    return future.result()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


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


class CallerLoop:
    """The sync client's loop: borrowed by the calling thread, run in the background only
    while background work is left (see the module docstring).

    ``background_busy`` (settable after construction) tells whether work other than calls is
    left on the loop, e.g. queued async writes; it is read on the loop's running thread.
    """

    def __init__(self, name: str, background_busy: Callable[[], bool] | None = None) -> None:
        self.loop = new_event_loop()
        self.background_busy = background_busy or (lambda: False)
        #: Called with True before and False after each synchronous stretch of a call run on
        #: the calling thread (the client lets master calls block that thread meanwhile).
        self.set_direct: Callable[[bool], None] = lambda on: None
        self._baton = threading.Lock()  # held by the thread running the loop
        self._mutex = threading.Lock()
        self._handed_over = 0  # calls handed to the loop and not finished yet
        self._kick = threading.Event()
        self._stopping = False
        self._helper = threading.Thread(target=self._serve_background, name=name, daemon=True)
        self._helper.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and return its result (or raise its exception).

        Raises ``UNAVAILABLE`` when the loop is stopped, ``INTERNAL_ERROR`` when called from a
        coroutine running on this loop (that would deadlock).
        """
        running = _running_loop()
        if running is self.loop:
            coro.close()
            raise KVPoolError(Status.INTERNAL_ERROR,
                              "a blocking client call was made from the client's own loop")
        if self._stopping:
            coro.close()
            raise KVPoolError(Status.UNAVAILABLE, "the client is closed")
        if running is None and self._baton.acquire(blocking=False):
            try:
                if self.loop.is_closed():
                    coro.close()
                    raise KVPoolError(Status.UNAVAILABLE, "the client is closed")
                return self._run_here(coro)
            except asyncio.CancelledError:
                raise KVPoolError(Status.UNAVAILABLE,
                                  "the client was closed during the call") from None
            finally:
                self._baton.release()
                if self._handed_over or self.background_busy():
                    self._kick.set()
        with self._mutex:
            self._handed_over += 1
        self._kick.set()  # whoever runs the loop now may stop before taking this call
        return _hand_over(self.loop, coro, self._finished_handover)

    def _run_here(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on this thread, which holds the baton: synchronously, with no loop
        iteration at all, as far as it gets without waiting (``set_direct`` lets its I/O block
        this thread meanwhile); if it has to wait, the rest runs on the loop, run here."""
        set_direct = self.set_direct
        asyncio._set_running_loop(self.loop)  # what it creates belongs to this loop
        set_direct(True)
        try:
            waiting_for = coro.send(None)
        except StopIteration as finished:
            return cast(T, finished.value)
        finally:
            set_direct(False)
            asyncio._set_running_loop(None)
        return self.loop.run_until_complete(_resume(coro, waiting_for))

    def _finished_handover(self) -> None:
        with self._mutex:
            self._handed_over -= 1

    def _serve_background(self) -> None:
        while True:
            self._kick.wait()
            self._kick.clear()
            with self._baton:
                if self.loop.is_closed():
                    return
                if self._stopping:
                    _cancel_all(self.loop)
                    return
                with contextlib.suppress(asyncio.CancelledError):  # stop() cancelled it
                    self.loop.run_until_complete(self._until_idle())

    async def _until_idle(self) -> None:
        while (self._handed_over or self.background_busy()) and not self._stopping:
            await asyncio.sleep(BACKGROUND_POLL_S)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Cancel what is left on the loop, close it and end the helper thread (idempotent).

        Raises ``INTERNAL_ERROR`` when called from a coroutine on this loop."""
        if _running_loop() is self.loop:
            raise KVPoolError(Status.INTERNAL_ERROR, "cannot stop a loop from inside it")
        self._stopping = True
        self._kick.set()
        # A call running on the loop (borrowed or handed over) must end: cancel it there.
        with contextlib.suppress(RuntimeError):  # already closed
            self.loop.call_soon_threadsafe(_cancel_tasks, self.loop)
        self._helper.join(timeout_s)
