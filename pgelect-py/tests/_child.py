"""A leader in a process of its own, driven by the tests over stdin/stdout:

    _child.py lead URL ROLE BACKEND TTL   prints "term N" once elected; then
                                          on "fence TABLE VALUE" runs a fenced
                                          insert and prints "ok" or the
                                          exception's class name
"""

import sys

import psycopg

import pgelect


def main() -> None:
    _, what, url, role, backend, ttl = sys.argv
    assert what == "lead"
    elector = pgelect.Elector(url, role, backend=backend, ttl=float(ttl))
    lead = elector.acquire()
    print(f"term {lead.term}", flush=True)
    for line in sys.stdin:
        cmd, table, value = line.split()
        assert cmd == "fence"
        try:
            with psycopg.connect(url) as conn, conn.transaction():
                lead.fence(conn)
                conn.execute(f"INSERT INTO {table} VALUES (%s)", (value,))
            print("ok", flush=True)
        except pgelect.PgelectError as e:
            print(type(e).__name__, flush=True)


if __name__ == "__main__":
    main()
