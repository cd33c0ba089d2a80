"""`manage.py post_entries`: writes entries as the leader of role
`ledger-writer`, each in a transaction fenced with its term, so that a
writer that was paused and replaced can never commit after its successor
began: the fence refuses (StaleTermError), and the command stops."""

import os

from django.core.management.base import BaseCommand
from django.db import connection, transaction

import pgelect
from ledger.models import Entry


class Command(BaseCommand):
    help = "Write entries as the leader only, every write fenced."

    def add_arguments(self, parser):  # type: ignore[no-untyped-def]
        parser.add_argument("--count", type=int, default=10)
        parser.add_argument("--every", type=float, default=0.1)
        parser.add_argument("--backend", default="lease")
        parser.add_argument("--ttl", type=float, default=10.0)

    def handle(self, *args, count, every, backend, ttl, **options):  # type: ignore[no-untyped-def]
        elector = pgelect.Elector(os.environ["DATABASE_URL"], "ledger-writer", backend=backend, ttl=ttl)
        with elector.leadership() as lead:
            self.stdout.write(f"elected term {lead.term}", ending="\n")
            self.stdout.flush()
            for n in range(count):
                try:
                    with transaction.atomic():
                        # The raw psycopg connection of Django's transaction.
                        lead.fence(connection.connection)
                        Entry.objects.create(term=lead.term, n=n)
                except pgelect.LeadershipLostError as e:
                    self.stdout.write(f"refused {type(e).__name__}: {e}")
                    return
                self.stdout.write(f"wrote {n}")
                self.stdout.flush()
                if lead.lost.wait(every):
                    self.stdout.write(f"lost {lead.lost.reason}")
                    return
        elector.close()
