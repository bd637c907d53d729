"""Where autotune keeps its files on a host.

State (engine records, daemon state, publish history) goes to $AUTOTUNE_STATE_DIR, else systemd's
$STATE_DIRECTORY, else $XDG_STATE_HOME/autotune (~/.local/state/autotune).
"""

from __future__ import annotations

import os
from pathlib import Path


def state_dir() -> Path:
    for var in ("AUTOTUNE_STATE_DIR", "STATE_DIRECTORY"):
        if os.environ.get(var):
            return Path(os.environ[var].split(":")[0])
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "autotune"


def atomic_write(path: Path, data: str | bytes, mode: int = 0o600) -> None:
    """Replace ``path`` so that a reader (or a crash) sees the old file or the new one, never half of it.

    Temp file in the same directory (rename is atomic only within a file system), fsync the
    data, rename over the target, fsync the directory so the rename itself survives a power cut.
    The file gets exactly ``mode``, whatever the umask: 0600 by default, since what autotune
    writes holds state or configs (0640 where a group reads it: production's vLLM config).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
