from __future__ import annotations

from typing import Any, Generator, Optional

from . import _native
from ._calls import Seconds, seconds, wait_async

_SLICE = 0.05


class LossSignal:
    """Set once a leadership or lock is lost. Like ``threading.Event``
    (``is_set()``, ``wait(timeout)``), and awaitable from asyncio
    (``await lead.lost``)."""

    __slots__ = ("_native",)

    def __init__(self, native: "_native.Signal") -> None:
        self._native = native

    def is_set(self) -> bool:
        """True once lost."""
        return self._native.is_set()

    def __bool__(self) -> bool:
        return self._native.is_set()

    def wait(self, timeout: Optional[Seconds] = None) -> bool:
        """Blocks (GIL released, Ctrl-C honoured) until set or ``timeout``
        seconds passed; returns ``is_set()``."""
        left = seconds(timeout)
        while True:
            step = _SLICE if left is None else min(_SLICE, max(left, 0.0))
            if self._native.wait(step):
                return True
            if left is not None:
                left -= step
                if left <= 0:
                    return self._native.is_set()

    @property
    def reason(self) -> Optional[str]:
        """Why it was set (``"connection_lost"``, ``"deadline"``,
        ``"preempted"``, ``"resigned"``, ``"shutdown"``, …), where known."""
        return self._native.reason()

    def __await__(self) -> Generator[Any, None, None]:
        return wait_async(self._native.call()).__await__()

    def __repr__(self) -> str:
        return f"<LossSignal set={self.is_set()} reason={self.reason!r}>"
