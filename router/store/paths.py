"""Where the router's store lives.

Rules, first match wins:
1. `$HUGPY_ROUTER_HOME`.
2. The first entry of `$STATE_DIRECTORY` (systemd's `StateDirectory=`; colon-separated when
   a unit lists several).
3. `<data dir>/router`, the data dir being `$XDG_DATA_HOME` or `~/.local/share`.
The file in that folder is `router.sqlite3`. Nothing here creates anything; `db.connect` does.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

DB_FILE = "router.sqlite3"


def store_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Returns the store folder by rules 1-3 (`environ` defaults to `os.environ`)."""
    env = os.environ if environ is None else environ
    home = env.get("HUGPY_ROUTER_HOME")
    if home:
        return Path(home)
    state = (env.get("STATE_DIRECTORY") or "").split(":")[0]
    if state:
        return Path(state)
    data = env.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(data) / "router"


def db_path(environ: Mapping[str, str] | None = None) -> Path:
    """Returns the store file's path: `store_dir(environ) / router.sqlite3`."""
    return store_dir(environ) / DB_FILE
