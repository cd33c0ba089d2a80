#!/usr/bin/env python
"""A Django project of one app, `ledger`, whose management command
`post_entries` writes only as the leader, every write fenced:

    DATABASE_URL=postgres://… python manage.py migrate
    DATABASE_URL=postgres://… python manage.py post_entries --count 100
"""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
