"""CallerLoop: the sync client's loop, borrowed by the calling thread or handed over.

No sockets: coroutines here only await each other, so every wait below is bounded by an
event that another part of the same test sets (a deadlock fails at the timeout instead).
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool_client._loopthread import CallerLoop, wait_for
from kvpool_wire.status import KVPoolError, Status

WAIT_S = 10.0


@pytest.fixture
def caller_loop() -> Iterator[CallerLoop]:
    runner = CallerLoop("test-caller-loop")
    yield runner
    runner.stop()


async def _thread_id() -> int:
    return threading.get_ident()


def test_an_uncontended_call_runs_on_the_calling_thread(caller_loop: CallerLoop) -> None:
    assert caller_loop.run(_thread_id()) == threading.get_ident()
    seen: list[int] = []
    worker = threading.Thread(target=lambda: seen.append(caller_loop.run(_thread_id())))
    worker.start()
    worker.join(WAIT_S)
    assert seen == [worker.ident]


def test_results_and_exceptions_come_back(caller_loop: CallerLoop) -> None:
    async def fail() -> None:
        raise KVPoolError(Status.NOT_FOUND, "missing")

    async def add(a: int, b: int) -> int:
        await asyncio.sleep(0)
        return a + b

    assert caller_loop.run(add(2, 3)) == 5
    with pytest.raises(KVPoolError) as info:
        caller_loop.run(fail())
    assert info.value.status == Status.NOT_FOUND


def test_a_call_made_while_another_thread_runs_the_loop_is_handed_over(
        caller_loop: CallerLoop) -> None:
    # A's call holds the loop until B's call (handed over to whoever runs it) sets the event.
    holder_ready = threading.Event()
    cross: list[asyncio.Event] = []
    results: dict[str, int] = {}

    async def hold() -> int:
        cross.append(asyncio.Event())
        holder_ready.set()
        await wait_for(cross[0].wait(), WAIT_S)
        return threading.get_ident()

    async def release() -> int:
        cross[0].set()
        return threading.get_ident()

    a = threading.Thread(target=lambda: results.__setitem__("a", caller_loop.run(hold())))
    a.start()
    assert holder_ready.wait(WAIT_S)
    results["b"] = caller_loop.run(release())  # would deadlock if B waited for the baton
    a.join(WAIT_S)
    assert results["a"] == a.ident
    assert results["b"] == a.ident  # B's coroutine ran on the loop A was running


def test_background_work_keeps_running_between_calls(caller_loop: CallerLoop) -> None:
    done = threading.Event()
    background: set[asyncio.Task[None]] = set()

    async def ticks() -> None:
        for _ in range(100):
            await asyncio.sleep(0)
        done.set()

    async def spawn() -> None:
        task = asyncio.get_running_loop().create_task(ticks())
        background.add(task)
        task.add_done_callback(background.discard)

    caller_loop.background_busy = lambda: bool(background)
    caller_loop.run(spawn())
    # No further call is made: the helper thread must finish the task.
    assert done.wait(WAIT_S)


def test_a_call_from_a_thread_running_its_own_loop_is_handed_over(
        caller_loop: CallerLoop) -> None:
    async def outer() -> int:
        return caller_loop.run(_thread_id())  # this thread's loop is running: cannot borrow

    seen: list[int] = []
    worker = threading.Thread(target=lambda: seen.append(asyncio.run(outer())))
    worker.start()
    worker.join(WAIT_S)
    assert seen and seen[0] != worker.ident


def test_a_blocking_call_from_the_loop_itself_is_refused(caller_loop: CallerLoop) -> None:
    async def nested() -> None:
        caller_loop.run(_thread_id())

    with pytest.raises(KVPoolError) as info:
        caller_loop.run(nested())
    assert info.value.status == Status.INTERNAL_ERROR


def test_calls_after_stop_are_refused() -> None:
    runner = CallerLoop("test-stopped")
    assert runner.run(_thread_id()) == threading.get_ident()
    runner.stop()
    runner.stop()  # idempotent
    coro = _thread_id()
    with pytest.raises(KVPoolError) as info:
        runner.run(coro)
    assert info.value.status == Status.UNAVAILABLE
    assert coro.cr_frame is None  # closed, never left pending


def test_stop_ends_calls_that_wait_forever() -> None:
    runner = CallerLoop("test-stop-waiting")
    started = threading.Semaphore(0)
    outcome: list[KVPoolError] = []

    async def forever() -> None:
        started.release()
        await asyncio.Event().wait()

    def call() -> None:
        try:
            runner.run(forever())
        except KVPoolError as exc:
            outcome.append(exc)

    # The first call borrows the loop; the second is handed over to it.
    callers = [threading.Thread(target=call) for _ in range(2)]
    for caller in callers:
        caller.start()
        assert started.acquire(timeout=WAIT_S)
    runner.stop()
    for caller in callers:
        caller.join(WAIT_S)
        assert not caller.is_alive()
    assert [exc.status for exc in outcome] == [Status.UNAVAILABLE] * 2


def test_a_call_that_never_waits_runs_without_a_loop_iteration(caller_loop: CallerLoop) -> None:
    direct: list[bool] = []
    caller_loop.set_direct = direct.append
    ran: list[str] = []

    async def quick() -> bool:
        loop = asyncio.get_running_loop()
        loop.call_soon(ran.append, "callback")  # runs at the loop's next iteration only
        return loop is caller_loop.loop

    assert caller_loop.run(quick()) is True
    assert direct == [True, False] and ran == []  # no iteration of the loop happened

    async def yield_once() -> None:
        await asyncio.sleep(0)

    caller_loop.run(yield_once())
    assert ran == ["callback"]


def test_a_call_that_waits_continues_on_the_loop(caller_loop: CallerLoop) -> None:
    direct: list[bool] = []
    caller_loop.set_direct = direct.append

    async def waits() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        failing: asyncio.Future[None] = loop.create_future()
        loop.call_soon(failing.set_exception, KVPoolError(Status.TIMEOUT, "late"))
        try:
            await failing  # the exception is thrown back into this coroutine
        except KVPoolError as exc:
            assert exc.status == Status.TIMEOUT
        done: asyncio.Future[int] = loop.create_future()
        loop.call_soon(done.set_result, 7)
        return await done, threading.get_ident()

    assert caller_loop.run(waits()) == (7, threading.get_ident())
    assert direct == [True, False]  # only the stretch before the first wait was direct

    async def fails_later() -> None:
        await asyncio.sleep(0)
        raise KVPoolError(Status.NOT_FOUND, "after a wait")

    with pytest.raises(KVPoolError) as info:
        caller_loop.run(fails_later())
    assert info.value.status == Status.NOT_FOUND


def test_client_code_needs_no_current_task() -> None:
    """The synchronous stretch of a call has no current task: asyncio.timeout (and, since
    Python 3.12, asyncio.wait_for) would raise there. The client uses _loopthread.wait_for."""
    root = Path(__file__).resolve().parents[2] / "kvpool_client"
    offenders = [f"{path.relative_to(root)}:{number}"
                 for path in sorted(root.rglob("*.py")) if "_pb" not in path.parts
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if re.search(r"asyncio\.(wait_for|timeout)\(", line)]
    assert offenders == []


async def test_wait_for_times_out_and_cancels() -> None:
    event = asyncio.Event()
    waiter = asyncio.ensure_future(event.wait())
    with pytest.raises(TimeoutError):
        await wait_for(waiter, 0.01)
    assert waiter.cancelled()
    event.set()
    assert await wait_for(event.wait(), None) is True
