"""Waiting for the native calls: blocking (GIL released, Ctrl-C honoured)
or from asyncio (task cancellation honoured). Either way, an interrupted
wait cancels the operation and returns only once it has stopped: no lock
or leadership is left held, no task left running."""

from __future__ import annotations

import asyncio
import datetime
import time
from typing import Any, Optional, Union

from . import _native

#: How often a blocking wait returns to the interpreter, so that a signal
#: handler (Ctrl-C's KeyboardInterrupt) runs. The wait itself wakes at once
#: when the operation completes.
_SLICE = 0.05

Seconds = Union[float, int, datetime.timedelta]


def seconds(value: Optional[Seconds]) -> Optional[float]:
    """A duration in seconds from a number or a ``timedelta``."""
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"a duration is a number of seconds or a timedelta, got {type(value).__name__}")
    return float(value)


def wait(call: "_native.Call", timeout: Optional[float] = None, what: str = "") -> Any:
    """Waits for ``call`` in this thread; on any exception (KeyboardInterrupt)
    cancels it, waits until it stopped, and re-raises. With ``timeout``
    (seconds), cancels it and raises ``TimeoutError`` naming ``what`` when
    it has not finished in time."""
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while not call.wait(_SLICE if deadline is None else max(0.0, min(_SLICE, deadline - time.monotonic()))):
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{what or 'the operation'}: not done within {timeout} s")
    except BaseException:
        call.cancel()
        raise
    return call.result()


async def wait_async(call: "_native.Call") -> Any:
    """Awaits ``call``; if the awaiting task is cancelled, cancels it and
    waits until it stopped (a few milliseconds at most) before re-raising."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def wake() -> None:
        if not done.done():
            done.set_result(None)

    def from_runtime() -> None:
        try:
            loop.call_soon_threadsafe(wake)
        except RuntimeError:  # the loop was closed meanwhile
            pass

    call.add_done_callback(from_runtime)
    try:
        await done
    except BaseException:
        call.cancel()
        raise
    return call.result()
