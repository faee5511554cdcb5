"""cancel_and_wait stops a task that swallows a cancellation (as asyncio.wait_for does on
Python 3.11 when its future completes just as it is cancelled), where `cancel(); await task`
waits for ever: the teardown hang seen in the dispatcher's placement link."""

from __future__ import annotations

import asyncio
import contextlib

from gpuloom.tasks import cancel_and_wait


async def _stubborn(swallow: int) -> None:
    """Loops; the first `swallow` cancellations are taken for a wake-up and ignored."""
    while True:
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            if swallow == 0:
                raise
            swallow -= 1


async def test_a_task_that_swallows_cancellations_is_stopped_all_the_same() -> None:
    task = asyncio.create_task(_stubborn(swallow=2))
    await asyncio.sleep(0.02)
    await asyncio.wait_for(cancel_and_wait(task, retry_s=0.05), timeout=5)
    assert task.cancelled()


async def test_one_cancel_and_an_await_hangs_on_such_a_task() -> None:
    """What the services' stop() did before: the task outlives the single cancel()."""
    task = asyncio.create_task(_stubborn(swallow=1))
    await asyncio.sleep(0.02)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=0.3)
    assert not done
    await cancel_and_wait(task, retry_s=0.05)


async def test_ended_tasks_and_their_exceptions_are_not_raised() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    failed = asyncio.create_task(fails())
    finished = asyncio.create_task(asyncio.sleep(0))
    await asyncio.sleep(0.01)
    await cancel_and_wait(failed, finished)
    assert failed.done() and finished.done() and not finished.cancelled()


async def test_a_loop_around_wait_for_woken_as_it_is_cancelled_is_stopped() -> None:
    """The placement link's loop: wait for a wake-up or the heartbeat interval. On Python 3.11
    a wake-up and a cancel() in the same turn lose the cancellation inside wait_for, and the
    loop runs on; cancel_and_wait stops it on any version."""

    async def link_loop(wake: asyncio.Event) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), 2.0)
            wake.clear()

    wake = asyncio.Event()
    task = asyncio.create_task(link_loop(wake))
    await asyncio.sleep(0.02)
    wake.set()
    task.cancel()  # the same turn: on 3.11 the task is still running after this
    await asyncio.sleep(0.05)
    await asyncio.wait_for(cancel_and_wait(task, retry_s=0.05), timeout=5)
    assert task.cancelled()
