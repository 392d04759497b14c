#!/usr/bin/env python
"""Django's command-line utility for administrative tasks."""

import os
import sys
from pathlib import Path


def local_defaults() -> None:
    """A checkout that `make run` has set up (its .secret_key is here) runs commands on the
    same defaults as `make run`: DEBUG on, which takes that key. Only when the environment
    sets neither DEBUG nor SECRET_KEY: a deployment sets SECRET_KEY (and its images hold
    no .secret_key)."""
    here = Path(__file__).resolve().parent
    if "DEBUG" in os.environ or os.environ.get("SECRET_KEY"):
        return
    if (here / ".secret_key").is_file():
        os.environ["DEBUG"] = "true"


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    local_defaults()
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
