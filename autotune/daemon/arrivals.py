"""Users' requests as the proxy in front of production logged them: what users offered, not what production finished.

vLLM's /metrics count the requests it finished; under saturation users give up in the queue and those
never show (window.py, ``Window.arrivals``). The proxy sees every request. The shipped nginx snippet
(systemd/nginx-autotune.conf) writes one line per request when it ends, served or not:

    log_format autotune_arrivals '$msec $request_time $status $request_method "$uri" $upstream_addr';

``ArrivalLog.read()`` reads the lines added since its last call and returns running totals of the users'
requests (a POST to an OpenAI path, ``/v1/...``: health checks and /metrics scrapes are not demand) and of
those that failed (5xx, a timeout, or 499: the user gave up before an answer). A request is counted when it
ends, so under saturation demand shows up to one client timeout late, but all of it shows. The totals are
the reader's own, from where the log stood when it was first read: they only grow, across a log rotation
(a renamed file is read to its end first) or a truncation (copytruncate) alike.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

__all__ = ["ArrivalCount", "ArrivalLog", "LOG_FORMAT"]

LOG_FORMAT = '$msec $request_time $status $request_method "$uri" $upstream_addr'
FAILED = frozenset({408, 429, 499})  # besides 5xx: the proxy or the client gave up, or production refused


@dataclass(frozen=True)
class ArrivalCount:
    """Running totals since the reader started."""

    arrived: int
    failed: int


def counts(line: str) -> tuple[bool, bool]:
    """(a user's request, and it failed) for one line in LOG_FORMAT; (False, False) for any other line."""
    fields = line.split()
    if len(fields) < 5 or fields[3] != "POST" or not fields[4].strip('"').startswith("/v1/"):
        return False, False
    try:
        status = int(fields[2])
    except ValueError:
        return False, False
    return True, status >= 500 or status in FAILED


class ArrivalLog:
    """Tails the proxy's arrivals log; ``read()`` never raises for a missing or unreadable file (``error`` says
    why, and the totals stay where they were until it can be read again)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.arrived = 0
        self.failed = 0
        self.error: str | None = None
        self._file: BinaryIO | None = None  # the open log, kept across a rotation until read to its end
        self._inode: int | None = None
        self._partial = b""
        self._started = False

    def read(self) -> ArrivalCount:
        try:
            self._follow()
            self.error = None
        except OSError as e:
            self.error = f"{self.path}: {e.strerror or e}"
        return ArrivalCount(self.arrived, self.failed)

    def _follow(self) -> None:
        first, self._started = not self._started, True
        if self._file is None:  # a log that appears after the first read is all new lines
            self._open(from_end=first)
            self._consume()
            return
        self._consume()  # the rest of the file we hold, even if it was renamed away meanwhile
        st = os.stat(self.path)  # after reading: nginx may append meanwhile, which only makes the file longer
        if st.st_ino != self._inode:  # rotated: the new file is all new lines
            self.close()
            self._open(from_end=False)
            self._consume()
        elif self._file is not None and st.st_size < self._file.tell():  # truncated in place (copytruncate)
            self._file.seek(0)
            self._partial = b""
            self._consume()

    def _open(self, *, from_end: bool) -> None:
        f = open(self.path, "rb")  # noqa: SIM115 - kept open on purpose: a rotation must not lose its last lines
        if from_end:  # what was logged before the daemon started is not this window's traffic
            f.seek(0, os.SEEK_END)
        self._file, self._inode, self._partial = f, os.fstat(f.fileno()).st_ino, b""

    def _consume(self) -> None:
        if self._file is None:
            return
        data = self._partial + self._file.read()
        lines = data.split(b"\n")
        self._partial = lines.pop()  # a line nginx is still writing
        for raw in lines:
            user, failed = counts(raw.decode("utf-8", "replace"))
            self.arrived += user
            self.failed += failed

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
