"""How the commands' printed hints spell a ``manage.py`` command: the way that works from
the shell the command ran in (``.venv/bin/python manage.py`` in a checkout set up by
``make setup``, ``python manage.py`` elsewhere, e.g. in the compose image)."""
from __future__ import annotations

import sys
from pathlib import Path

from django.conf import settings


def manage_py(arguments: str) -> str:
    venv = Path(settings.BASE_DIR) / ".venv"
    interpreter = Path(sys.executable)
    python = ".venv/bin/python" if interpreter.is_relative_to(venv) else "python"
    return f"{python} manage.py {arguments}"
