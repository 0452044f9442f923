"""Writing a file whole or not at all: the boxes file, the installer's unit and env files.

`write_atomically(path, data, mode, owner, group)`, safe against planted links (issue 20 item 11:
a predictable temp name, opened without O_EXCL, let a planted symlink receive the env text,
admin key included, with the victim's mode):
1. The temp file is made by `tempfile.mkstemp` in the target's directory: a random name,
   created with O_CREAT|O_EXCL (never an existing file, never through a symlink), mode 0600.
2. Its mode and owner are set on the descriptor before a byte is written, so the data is never
   readable by more than `mode` allows, not even for a moment.
3. It is flushed and fsynced, then `os.replace` renames it over `path`: a reader sees the old
   file or the new one, never half of one, and a symlink at `path` is replaced, never followed.
4. On any error the temp file is removed and `path` is left as it was.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import tempfile
from pathlib import Path


def write_atomically(path: Path, data: bytes, mode: int = 0o600, owner: str | None = None,
                     group: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), mode)
            if owner or group:
                os.fchown(handle.fileno(), _uid(owner), _gid(group))
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _uid(owner: str | None) -> int:
    return -1 if owner is None else pwd.getpwnam(owner).pw_uid


def _gid(group: str | None) -> int:
    return -1 if group is None else grp.getgrnam(group).gr_gid
