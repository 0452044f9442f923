"""The `hugpy-router` script this venv installed, and a clean environment to run it in."""

from __future__ import annotations

import os
import sys
from pathlib import Path

EXE = Path(sys.executable).parent / "hugpy-router"


def home_env(tmp_path: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HUGPY_", "XDG_")) and k not in ("STATE_DIRECTORY", "NOTIFY_SOCKET")}
    env.update(HOME=str(tmp_path / "home"), **extra)
    return env
