"""The per-event-loop parking hooks: the cheapest way to sleep and wake on asyncio and trio.

The transfer hot path parks and wakes callers once per transfer; anyio's portable
primitives cost several times more, so each loop gets its own small set of tools here,
behind one interface (:class:`LoopTools`).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Awaitable, Callable, Generator
from typing import Any, NamedTuple, Protocol

#: ``unpark_all``'s default limit: every sleeper listed.
ALL = 1 << 62


def no_recancel(exc: BaseException) -> None:
    """``LoopTools.recancel`` where the loop raises an absorbed cancellation again itself."""


def no_task() -> object:
    """The task lookup of a component not yet bound to a loop (``LoopTools.current_task``)."""
    return None


class LoopTools(NamedTuple):
    """Cheap per-call tools of the event loop an engine runs in (the transfer hot path
    calls them per transfer; anyio's portable versions cost several times more)."""

    current_task: Callable[[], object]
    event: Callable[[], NativeEvent]
    #: ``await park(waiters)`` sleeps until ``unpark_all(waiters)``; a cancelled sleeper
    #: drops out alone (the others stay parked). Many callers of one merged request wait
    #: this way: a bare future (asyncio) or a parked task (trio), no event object per wait.
    park: Callable[[list[Any]], Awaitable[None]]
    unpark_all: Unpark
    #: One trip through the loop (the tasks already scheduled run first); cancellable.
    yield_now: Callable[[], Awaitable[None]]
    #: Whether a cancellation that an operation absorbs (because it had already completed)
    #: is raised again at the task's next checkpoint, once handed to ``recancel``: on trio
    #: by itself (a cancel scope stays cancelled); on asyncio ``recancel`` requests it again.
    redelivers_cancel: bool = False
    #: Called with an absorbed cancellation, in the task that absorbed it.
    recancel: Callable[[BaseException], None] = no_recancel
    #: Where a task can run without a pass through the loop (asyncio's eager tasks, Python
    #: 3.12+): schedules a callback for the loop's next pass, to tell that one happened.
    #: None where every task switch is a pass (trio).
    call_soon: Callable[[Callable[[], None]], object] | None = None
    #: Where every call of a library must at least be a cancellation point (trio's rule):
    #: raises if the task's scope is cancelled, else returns without a trip through the
    #: loop. None on asyncio, which has no such rule (a call that finishes without
    #: awaiting is not cancelled there).
    cancel_point: Callable[[], Awaitable[None]] | None = None


class Unpark(Protocol):
    def __call__(self, waiters: list[Any], limit: int = ..., /) -> int:
        """Wake up to ``limit`` (default: all) sleepers from the front of ``waiters`` and
        drop them, and the cancelled ones passed on the way, from the list; returns how
        many it woke."""


class NativeEvent(Protocol):
    def set(self) -> None: ...
    def is_set(self) -> bool: ...
    async def wait(self) -> Any: ...


def loop_tools() -> LoopTools:
    """The :class:`LoopTools` of the running loop (asyncio or trio)."""
    try:
        import trio
        import trio.lowlevel

        trio.lowlevel.current_task()  # raises RuntimeError outside a trio run
        return _trio_tools(trio)
    except (ImportError, RuntimeError):
        import asyncio
        import asyncio.tasks

        loop = asyncio.get_running_loop()
        current = _asyncio_current_task(asyncio, loop)
        # asyncio's own loops build a plain Future: made here directly, without the Python
        # frame of BaseEventLoop.create_future (other loops keep their own factory).
        new_future: Callable[[], asyncio.Future[Any]] = loop.create_future
        if type(loop).create_future is asyncio.BaseEventLoop.create_future:
            new_future = functools.partial(asyncio.Future, loop=loop)

        def park(waiters: list[Any]) -> Awaitable[None]:
            # One future per sleeper: cancelling a task cancels the future it awaits, and
            # that must not touch the others.
            future = new_future()
            waiters.append(future)
            return future

        def recancel(exc: BaseException) -> None:
            # The task absorbed the CancelledError that a cancel() request threw into it:
            # request it again once the task has gone on to its next await (the loop's next
            # round), so that this await raises it, with its message (anyio reads it). Not if
            # by then the scope that asked has ended: a scope calls uncancel() on its way
            # out, so Task.cancelling() fell. Asking again at once would outlive such a
            # scope (before Python 3.13 uncancel() leaves a requested cancel armed) and
            # raise at whatever await follows it.
            task = current()
            if task is not None:
                loop.call_soon(_cancel_again, task, task.cancelling(),
                               exc.args[0] if exc.args else None)

        return LoopTools(current, asyncio.Event, park, _asyncio_unpark_all, _asyncio_yield,
                         True, recancel, loop.call_soon)


def _asyncio_current_task(asyncio: Any, loop: Any) -> Callable[[], Any]:
    """The running task of ``loop``: read straight from asyncio's private task table where
    that table answers right now (a dict lookup, a third of ``current_task(loop)``'s cost),
    else the public ``asyncio.current_task``. Python 3.14's C tasks keep the current task
    in the thread state and leave the table empty (gh-129898); an interpreter or loop may not
    have it at all. Decided once, from inside a running task (where the engine opens)."""
    public = functools.partial(asyncio.current_task, loop)
    table = _private_task_table(asyncio)
    if table is not None:
        fast = functools.partial(table.get, loop)
        task = public()
        if task is not None and fast() is task:
            return fast
    return public


def _private_task_table(asyncio: Any) -> dict[Any, Any] | None:
    """asyncio's table of running tasks by loop, if this interpreter has one by that name."""
    table = getattr(asyncio.tasks, "_current_tasks", None)
    return table if isinstance(table, dict) else None


def _cancel_again(task: Any, cancelling: int, message: object) -> None:
    """``recancel``'s second half on asyncio: the absorbed request again, counted once (take
    it back, then ask again: asyncio.timeout and anyio compare Task.cancelling() counts),
    while the request is still counted (its scope has not ended) and the task still runs."""
    if not task.done() and task.cancelling() >= cancelling:
        task.uncancel()
        task.cancel(message)


class _AsyncioYield:
    """``await`` it to go once through an asyncio loop: a bare yield, which the task
    answers by scheduling its next step behind everything already scheduled."""

    __slots__ = ()

    def __await__(self) -> Generator[None, None, None]:
        yield


_ASYNCIO_YIELD = _AsyncioYield()


def _asyncio_yield() -> Awaitable[None]:
    return _ASYNCIO_YIELD


def _asyncio_unpark_all(waiters: list[Any], limit: int = ALL) -> int:
    woken = seen = 0
    for future in waiters:
        seen += 1
        if not future.done():  # a cancelled sleeper's is
            future.set_result(None)
            woken += 1
            if woken == limit:
                break
    del waiters[:seen]
    return woken


def _trio_tools(trio: Any) -> LoopTools:
    lowlevel = trio.lowlevel
    current_task, reschedule, wait = lowlevel.current_task, lowlevel.reschedule, \
        lowlevel.wait_task_rescheduled
    run_context = _trio_run_context()
    if run_context is not None:
        # This run's scheduler itself: the public functions are wrappers that look it up on
        # every call (2-4% of a merged member's time at 64 and 1024 in flight, A/B).
        reschedule = run_context.runner.reschedule
    succeeded = lowlevel.Abort.SUCCEEDED
    from outcome import Value  # trio's own dependency

    class Resumed(Value):  # type: ignore[misc,type-arg]  # Value is final to type checkers
        """What a woken sleeper gets: one shared outcome that can be unwrapped again and
        again, instead of a fresh ``Value(None)`` (and its used-once check) per wake.
        ``wait_task_rescheduled`` only unwraps what it is sent."""

        __slots__ = ()

        def unwrap(self) -> None:
            return None

    resumed = Resumed(None)

    # A sleeper is its task, listed in ``waiters``, with ``custom_sleep_data`` pointing at
    # that list: trio clears it whenever the task is rescheduled, so a sleeper that was
    # cancelled (its abort just says yes and leaves it listed) or already woken is skipped.
    # No object per sleeper, and one abort function for all of them.
    def abort(_: object) -> Any:
        return succeeded

    sleep = _trio_sleep(abort) or functools.partial(wait, abort)

    # ``.task`` is what current_task() returns; trio's run state has it without a call.
    context = run_context if run_context is not None else _PublicRunContext(current_task)

    def park(waiters: list[Any]) -> Awaitable[None]:
        task = context.task
        task.custom_sleep_data = waiters
        waiters.append(task)
        return sleep()

    def unpark_all(waiters: list[Any], limit: int = ALL) -> int:
        woken = seen = 0
        for task in waiters:
            seen += 1
            if task.custom_sleep_data is waiters:
                reschedule(task, resumed)
                woken += 1
                if woken == limit:
                    break
        del waiters[:seen]
        return woken

    return LoopTools(current_task, trio.Event, park, unpark_all, lowlevel.checkpoint, True,
                     cancel_point=lowlevel.checkpoint_if_cancelled)


class _PublicRunContext:
    """Stands in for trio's run state where it is missing: ``task`` asks the public function."""

    __slots__ = ("_current_task",)

    def __init__(self, current_task: Callable[[], Any]) -> None:
        self._current_task = current_task

    @property
    def task(self) -> Any:
        return self._current_task()


def _trio_run_context() -> Any:
    """trio's per-thread run state (``runner``, and ``task`` inside a task), or None if
    this trio has none by that name: then the public functions serve."""
    try:
        from trio._core._run import GLOBAL_RUN_CONTEXT

        GLOBAL_RUN_CONTEXT.runner.reschedule  # noqa: B018  # inside a run, as callers are
        GLOBAL_RUN_CONTEXT.task  # noqa: B018
    except (ImportError, AttributeError):
        return None
    return GLOBAL_RUN_CONTEXT


def _trio_sleep(abort: Callable[[object], Any]) -> Callable[[], Awaitable[None]] | None:
    """``wait_task_rescheduled(abort)`` minus its wrappers: yield trio's own "wait until
    rescheduled" message, built once, and unwrap what comes back (what the public function
    does, with two coroutines and a message per call). None, to use the public function,
    if this trio has no such message."""
    try:
        from trio._core._traps import WaitTaskRescheduled

        message = WaitTaskRescheduled(abort)  # frozen; trio reads only its abort_func
    except (ImportError, TypeError):
        return None

    @types.coroutine
    def sleep() -> Generator[Any, Any, None]:
        resumed = yield message
        return resumed.unwrap()  # type: ignore[no-any-return]

    return sleep
