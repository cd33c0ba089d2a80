"""The fixtures of pgelect_support (a throwaway PostgreSQL and PgBouncer)."""

from pgelect_support import bouncer_url, role, servers, url  # noqa: F401
