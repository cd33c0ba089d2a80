from django.db import models


class Entry(models.Model):
    """A row only the leader writes, stamped with its fencing term."""

    term = models.BigIntegerField()
    n = models.IntegerField()
