"""Settings for pytest: the project's, in development mode unless the environment says
otherwise, as `make run`/`make test` (scripts/dev.py) run it.

``DEBUG`` is off by default (config/settings.py); with it off, ``SECRET_KEY`` must be set.
Tests, and the servers and daemons they start (which inherit this environment and
``DJANGO_SETTINGS_MODULE``), use the development key file instead. pytest-django keeps
``settings.DEBUG`` off inside the test process whatever this says.
"""
import os

os.environ.setdefault("DEBUG", "true")

from config.settings import *  # noqa: E402,F403
