"""Where the router's files live: the hugpy layout, resolved as hugpy-router 0.0.4 resolves it.

Rules, first match wins in each list:
1. The hugpy config dir: `$HUGPY_CONFIG_DIR`, else platformdirs' user config dir for app
   `hugpy` (`$XDG_CONFIG_HOME/hugpy`, else `~/.config/hugpy` on Linux). The hugpy data dir:
   `$HUGPY_DATA_DIR`, else platformdirs' user data dir for `hugpy` (`$XDG_DATA_HOME/hugpy`,
   else `~/.local/share/hugpy`). This is hugpy-wrapper's `app_dirs`, which 0.0.4 uses.
2. The boxes file: `$HUGPY_ROUTER_BOXES`, else `<config dir>/router/boxes.json`.
3. The store folder: `$HUGPY_ROUTER_HOME` (user-expanded, absolute), else the first entry of
   `$STATE_DIRECTORY` (systemd's `StateDirectory=`; colon-separated when a unit lists
   several), else `<data dir>/router`. The file in it is `router.sqlite3`.
4. The store's sharing (`$HUGPY_ROUTER_STORE_MODE`): `private` (default; folder 0700, files
   0600) or `group` (folder 0750, files 0640, SQLite's `-shm` index 0660, group `hugpy` when
   that group exists and this process may give files to it), what `install --system` sets
   so that other hugpy components can read the store. An unknown value counts as private.
Nothing here creates anything; `db.connect` does, with `store_modes()`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, NamedTuple

import platformdirs

APP = "hugpy"
SUBDIR = "router"
DB_FILE = "router.sqlite3"
BOXES_FILE = "boxes.json"
SHARED_GROUP = "hugpy"


class StoreModes(NamedTuple):
    folder: int
    file: int
    shm: int  # SQLite's shared-memory index: every reader writes its read marks into it
    group: str | None


PRIVATE = StoreModes(0o700, 0o600, 0o600, None)
GROUP = StoreModes(0o750, 0o640, 0o660, SHARED_GROUP)


def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def config_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Returns the hugpy config dir (rule 1)."""
    explicit = _env(environ).get("HUGPY_CONFIG_DIR", "").strip()
    return Path(explicit) if explicit else Path(platformdirs.user_config_dir(APP, appauthor=False))


def data_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Returns the hugpy data dir (rule 1)."""
    explicit = _env(environ).get("HUGPY_DATA_DIR", "").strip()
    return Path(explicit) if explicit else Path(platformdirs.user_data_dir(APP, appauthor=False))


def boxes_path(environ: Mapping[str, str] | None = None) -> Path:
    """Returns the boxes file's path (rule 2)."""
    explicit = _env(environ).get("HUGPY_ROUTER_BOXES", "").strip()
    return Path(explicit) if explicit else config_dir(environ) / SUBDIR / BOXES_FILE


def store_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Returns the store folder (rule 3)."""
    env = _env(environ)
    home = env.get("HUGPY_ROUTER_HOME", "").strip()
    if home:
        return Path(os.path.abspath(os.path.expanduser(home)))
    state = (env.get("STATE_DIRECTORY") or "").split(":")[0].strip()
    if state:
        return Path(state)
    return data_dir(environ) / SUBDIR


def db_path(environ: Mapping[str, str] | None = None) -> Path:
    """Returns the store file's path: `store_dir(environ) / router.sqlite3`."""
    return store_dir(environ) / DB_FILE


def store_modes(environ: Mapping[str, str] | None = None) -> StoreModes:
    """Returns the store's modes and group (rule 4)."""
    mode = _env(environ).get("HUGPY_ROUTER_STORE_MODE", "").strip().lower()
    return GROUP if mode == "group" else PRIVATE
