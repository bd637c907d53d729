"""Where autotune keeps its files on a host.

State (engine records, daemon state) goes to $AUTOTUNE_STATE_DIR, else systemd's
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
