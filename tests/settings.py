"""Settings for pytest: the project's, in development mode unless the environment says
otherwise, as `make run`/`make test` (scripts/dev.py) run it.

``DEBUG`` is off by default (config/settings.py); with it off, ``SECRET_KEY`` must be set.
Tests, and the servers and daemons they start (which inherit this environment and
``DJANGO_SETTINGS_MODULE``), use the development key file instead. pytest-django keeps
``settings.DEBUG`` off inside the test process whatever this says.
"""
import os

os.environ.setdefault("DEBUG", "true")
# A dead daemon's request waits this long for another to continue it (production: 60 s).
# Tests that kill daemons without bringing one back would wait that long for their answer;
# the chaos tests that bring one back set their own.
os.environ.setdefault("RECOVERY_TIMEOUT_S", "3")
# The prompt cache's disk tier writes under a folder of the test run's, never the checkout's
# (the live servers give each of theirs a folder of its own: tests/live_service.py).
if "PROMPT_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["PROMPT_CACHE_DIR"] = tempfile.mkdtemp(prefix="prompt-cache-test-")
# Adapters are registered from a folder of the test run's (tests make their files there).
if "ADAPTERS_DIR" not in os.environ:
    import tempfile

    os.environ["ADAPTERS_DIR"] = tempfile.mkdtemp(prefix="adapters-test-")

from config.settings import *  # noqa: E402,F403
