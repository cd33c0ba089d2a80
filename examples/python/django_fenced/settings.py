"""Settings of the example: one PostgreSQL database from DATABASE_URL,
through Django's psycopg 3 backend."""

import os
from urllib.parse import unquote, urlsplit

_url = urlsplit(os.environ["DATABASE_URL"])

SECRET_KEY = "example-only"
INSTALLED_APPS = ["ledger"]
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _url.path.lstrip("/"),
        "USER": unquote(_url.username or ""),
        "PASSWORD": unquote(_url.password or ""),
        "HOST": _url.hostname,
        "PORT": _url.port,
    }
}
