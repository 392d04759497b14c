"""The web process takes what it loaded out of the collector's reach (config/asgi.py's
gc.freeze): a full collection that walked every Django object stalled every stream of the
process (60-65 ms every ~3 s with 256 streams, bench/web_capacity.py)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = ("import gc, config.asgi, sys; "
         "print(gc.get_freeze_count(), 'inference.api_views' in sys.modules)")


def test_the_asgi_app_freezes_what_it_loaded_with_the_views():
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    frozen, views_loaded = int(out[0]), out[1] == "True"
    assert views_loaded  # the URL conf (and the API's views) loaded before the freeze
    assert frozen > 50_000  # Django, DRF, the apps and the views
