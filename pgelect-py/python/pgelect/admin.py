"""The admin side: who leads a role, and asking it to step down (what
``pgelect status`` and ``pgelect resign`` do)."""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from typing import Any, Dict, Optional

from . import _native
from ._calls import Seconds, seconds, wait, wait_async

__all__ = ["LeaderInfo", "status", "status_async", "resign", "resign_async"]


@dataclass(frozen=True)
class LeaderInfo:
    """A role's leader, as its lease row says."""

    role: str
    holder: str
    term: int
    acquired_at: datetime.datetime
    renewed_at: datetime.datetime
    lease_until: datetime.datetime
    lease_expired: bool
    backend: Optional[str]
    holder_pid: Optional[int]
    holder_meta: Optional[Any]

    @classmethod
    def _from(cls, d: Optional[Dict[str, Any]]) -> Optional["LeaderInfo"]:
        if d is None:
            return None
        utc = datetime.timezone.utc
        at = lambda k: datetime.datetime.fromtimestamp(d[k], tz=utc)  # noqa: E731
        meta = d["holder_meta"]
        return cls(
            role=d["role"],
            holder=d["holder"],
            term=d["term"],
            acquired_at=at("acquired_at"),
            renewed_at=at("renewed_at"),
            lease_until=at("lease_until"),
            lease_expired=d["lease_expired"],
            backend=d["backend"],
            holder_pid=d["holder_pid"],
            holder_meta=None if meta is None else json.loads(meta),
        )


def status(url: str, role: str, *, schema: Optional[str] = None, connect_timeout: Optional[Seconds] = None) -> Optional[LeaderInfo]:
    """The role's current leader, or ``None`` while nobody holds it."""
    return LeaderInfo._from(wait(_native.current_leader(url, role, schema=schema, connect_timeout=seconds(connect_timeout))))


async def status_async(url: str, role: str, *, schema: Optional[str] = None, connect_timeout: Optional[Seconds] = None) -> Optional[LeaderInfo]:
    return LeaderInfo._from(await wait_async(_native.current_leader(url, role, schema=schema, connect_timeout=seconds(connect_timeout))))


def resign(url: str, role: str, *, schema: Optional[str] = None, connect_timeout: Optional[Seconds] = None) -> Optional[LeaderInfo]:
    """Asks the role's leader to step down (its ``lost`` is set, reason
    ``"preempted"`` or as the library reports it); returns the leader asked,
    or ``None`` when there was none. Needs the grant of an operator."""
    return LeaderInfo._from(wait(_native.request_resign(url, role, schema=schema, connect_timeout=seconds(connect_timeout))))


async def resign_async(url: str, role: str, *, schema: Optional[str] = None, connect_timeout: Optional[Seconds] = None) -> Optional[LeaderInfo]:
    return LeaderInfo._from(await wait_async(_native.request_resign(url, role, schema=schema, connect_timeout=seconds(connect_timeout))))
