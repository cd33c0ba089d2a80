"""Celery beat on the leader only: run this on every replica; exactly one
of them sends the periodic tasks, and a rolling restart hands the
schedule over (SIGTERM: the leader stops beat, then resigns, and a standby
takes over at once).

    DATABASE_URL=postgres://… python leader_beat.py REPLICA_NAME

The broker here is kombu's filesystem transport (BROKER_DIR), so the
example needs no RabbitMQ or Redis; use your own broker URL in production.
Each send is printed as ``sent <monotonic> <replica> <term>`` for the
example's test (test_celery_beat.py) to check.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from celery import Celery
from celery.beat import Scheduler, Service

import pgelect

broker_dir = os.environ.get("BROKER_DIR", "/tmp/pgelect-celery-broker")
os.makedirs(broker_dir, exist_ok=True)
app = Celery(
    "leader_beat",
    broker="filesystem://",
    broker_transport_options={
        "data_folder_in": broker_dir,
        "data_folder_out": broker_dir,
        "control_folder": os.path.join(broker_dir, "control"),
    },
)
app.conf.beat_schedule = {"tick": {"task": "leader_beat.tick", "schedule": 0.2}}


@app.task(name="leader_beat.tick")
def tick(replica: str, term: int) -> None:
    """What the workers run; the term lets them fence their writes."""


class LeaderScheduler(Scheduler):
    """The in-memory scheduler, stamping each task with this leadership's
    replica and term (workers fence with the term)."""

    replica = ""
    term = 0

    def apply_async(self, entry, producer=None, advance=True, **kwargs):  # type: ignore[no-untyped-def]
        entry.args = (self.replica, self.term)
        result = super().apply_async(entry, producer, advance, **kwargs)
        print(f"sent {time.monotonic():.6f} {self.replica} {self.term}", flush=True)
        return result


def main() -> None:
    replica = sys.argv[1]
    elector = pgelect.Elector(os.environ["DATABASE_URL"], "celery-beat", node_id=replica, ttl=float(os.environ.get("TTL", "10")))
    # A rolling restart's SIGTERM: stop beat, resign, exit.
    signal.signal(signal.SIGTERM, lambda *_: elector.shutdown())

    def on_elected(lead: pgelect.Leadership) -> None:
        print(f"elected {replica} term {lead.term}", flush=True)
        scheduler = type("Scheduler", (LeaderScheduler,), {"replica": replica, "term": lead.term})
        beat = Service(app, max_interval=0.1, scheduler_cls=scheduler)
        thread = threading.Thread(target=beat.start, name="beat")
        thread.start()
        lead.lost.wait()  # lost, or shut down
        beat.stop(wait=True)  # no send after this returns
        thread.join()

    def on_demoted() -> None:
        print(f"demoted {replica}", flush=True)

    print(f"standing {replica}", flush=True)
    elector.run(on_elected, on_demoted)
    elector.close()


if __name__ == "__main__":
    main()
