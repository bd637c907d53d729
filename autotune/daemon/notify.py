"""systemd's sd_notify protocol: readiness, status text and watchdog pings for Type=notify.

Hand-written on purpose: the protocol is one datagram of ``KEY=VALUE`` lines sent to the
AF_UNIX socket named by ``$NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract
namespace), which is a few lines of stdlib; python-systemd would need libsystemd headers and
a compiler (it is not on PyPI as a wheel), and a C dependency for one ``sendto`` is not worth it.

Every function is a no-op returning False when ``$NOTIFY_SOCKET`` is unset (not started by
systemd, tests, a terminal), so callers never need to check. A socket that is set but cannot
be reached raises ``OSError``: that is a broken deployment, not something to hide.

    notify.ready()                       # READY=1, after start-up
    notify.status("studying: trial 12")  # STATUS=..., shown by `systemctl status`
    every = notify.watchdog_interval()   # WatchdogSec= in seconds, or None
    notify.watchdog()                    # WATCHDOG=1, at least every `every / 2` seconds
    notify.stopping()                    # STOPPING=1, on the way out
"""

from __future__ import annotations

import os
import re
import socket
import time

__all__ = ["notify", "ready", "status", "stopping", "watchdog", "watchdog_interval"]

_KEY = re.compile(r"[A-Z_][A-Z0-9_]*")


def _address(value: str) -> str | None:
    if value.startswith("@"):
        return "\0" + value[1:]  # abstract namespace: a leading NUL byte instead of '@'
    if value.startswith("/"):
        return value
    return None  # vsock:... and other transports of newer systemd: not supported here


def notify(**fields: object) -> bool:
    """Send ``KEY=VALUE`` lines, in the order given, as one datagram to ``$NOTIFY_SOCKET``.

    True when sent; False when ``$NOTIFY_SOCKET`` is unset, or names a transport other than
    an AF_UNIX socket. ``notify(READY=1, STATUS="up")`` sends ``b"READY=1\\nSTATUS=up"``.
    """
    if not fields:
        raise ValueError("notify() needs at least one field")
    lines = []
    for key, value in fields.items():
        text = str(value)
        if not _KEY.fullmatch(key):
            raise ValueError(f"not a notification field name: {key!r}")
        if "\n" in text:
            raise ValueError(f"{key}: a value cannot span lines")
        lines.append(f"{key}={text}")
    address = _address(os.environ.get("NOTIFY_SOCKET", ""))
    if address is None:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto("\n".join(lines).encode(), address)
    return True


def ready() -> bool:
    """READY=1: start-up is done (Type=notify units count as started only now)."""
    return notify(READY=1)


def status(text: str) -> bool:
    """STATUS=<text>: one line for `systemctl status` (newlines become spaces)."""
    return notify(STATUS=" ".join(text.splitlines()))


def watchdog() -> bool:
    """WATCHDOG=1: still alive. Send at least every half of ``watchdog_interval()``."""
    return notify(WATCHDOG=1)


def reloading() -> bool:
    """RELOADING=1 (with the monotonic clock, as systemd 253+ asks): re-reading the config; READY=1 ends it."""
    return notify(RELOADING=1, MONOTONIC_USEC=time.monotonic_ns() // 1000)


def stopping() -> bool:
    """STOPPING=1: shutting down (systemd then waits up to TimeoutStopSec=)."""
    return notify(STOPPING=1)


def watchdog_interval() -> float | None:
    """The unit's WatchdogSec= in seconds, or None when no watchdog watches this process.

    From ``$WATCHDOG_USEC``; ``$WATCHDOG_PID``, when set, must be this process (a child that
    inherited the environment is not the one watched), as in sd_watchdog_enabled(3).
    """
    try:
        usec = int(os.environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    return usec / 1_000_000
