"""The production watcher: what production's vLLM serves, read from its ``/metrics``, and what users offered,
read from the proxy's log where there is one.

``Watcher`` keeps a ring of snapshots (``scrape``, prometheus.py; the proxy's running totals, arrivals.py)
and turns each ``poll()`` into the latest window (``Window``, window.py). It has no thread and no timer:
the daemon calls ``poll()`` on its own schedule. Scrape errors are counted, never raised.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Self

import httpx

from autotune.daemon.arrivals import ArrivalLog
from autotune.daemon.prometheus import Snapshot, scrape
from autotune.daemon.window import Window, level_change

__all__ = ["Watcher"]


class Watcher:
    """Scrapes production on demand and keeps a ring of snapshots to make windows from.

    ``poll()`` returns the window from the newest snapshot at least ``window_s`` old to the new
    one (or from the oldest kept, while the ring is younger than that: ``Window.dt`` tells);
    None on the first poll and on scrape errors, which are counted, never raised, so a
    production restart does not stop the daemon. After a counter reset the older snapshots
    belong to the previous process and are dropped.
    """

    def __init__(
        self,
        url: str,
        *,
        window_s: float = 300.0,
        keep: int = 256,
        timeout: float = 5.0,
        client: httpx.Client | None = None,
        scraper: Callable[[str, httpx.Client | None, float], Snapshot] = scrape,
        arrivals: ArrivalLog | None = None,
    ) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.url = url
        self.window_s = window_s
        self.timeout = timeout
        self.snapshots: deque[Snapshot] = deque(maxlen=max(2, keep))
        self.errors = 0  # scrape errors since start
        self.consecutive_errors = 0
        self.last_error: str | None = None
        self.resets = 0  # production restarts seen
        # one client for every poll (a kept-alive connection); closed by close() only when it is ours
        self._owns_client = client is None
        self._client = client if client is not None else httpx.Client(timeout=timeout, trust_env=False)
        self._scraper = scraper
        self.arrivals = arrivals  # the proxy's log of users' requests, read at each successful scrape

    def poll(self) -> Window | None:
        try:
            snap = self._scraper(self.url, self._client, self.timeout)
        except (httpx.HTTPError, ValueError, OSError) as e:
            self.errors += 1
            self.consecutive_errors += 1
            # one line: httpx adds "For more information check: ..." on a second line of its own
            text = str(e).strip().splitlines()[0] if str(e).strip() else ""
            self.last_error = f"{type(e).__name__}: {text}" if text else type(e).__name__
            return None
        self.consecutive_errors = 0
        if self.arrivals is not None:
            snap = replace(snap, proxy=self.arrivals.read())
        return self.add(snap)

    def add(self, snap: Snapshot) -> Window | None:
        """Take a snapshot (scraped elsewhere, or in tests) and return the latest window."""
        if self.snapshots:
            last = self.snapshots[-1]
            step = Window.between(last, snap)
            if step.reset:
                self.resets += 1
                self.snapshots.clear()
                self.snapshots.append(snap)
                return step
        self.snapshots.append(snap)
        return self.window()

    def window(self) -> Window | None:
        """The latest window over ``window_s`` from the kept snapshots (None with fewer than two)."""
        snaps = self._span()
        return None if snaps is None else Window.between(snaps[0], snaps[-1], snaps[1:-1])

    def since_change(self, min_span_s: float) -> Window | None:
        """The part of the latest window since the arrival rate last changed level (``level_change``: each side
        ``min_span_s`` long at least); None when one level explains the whole window."""
        snaps = self._span()
        if snaps is None:
            return None
        k = level_change(snaps, min_span_s)
        return None if k is None else Window.between(snaps[k], snaps[-1], snaps[k + 1 : -1])

    def recent(self, span_s: float) -> Window | None:
        """The newest scrapes that span ``span_s`` at least (None: fewer than that)."""
        snaps = self._span()
        if snaps is None:
            return None
        for i in range(len(snaps) - 2, -1, -1):
            if snaps[-1].t - snaps[i].t >= span_s:
                return Window.between(snaps[i], snaps[-1], snaps[i + 1 : -1])
        return None

    def _span(self) -> list[Snapshot] | None:
        """The kept snapshots of the latest window, oldest first (None with fewer than two)."""
        if len(self.snapshots) < 2:
            return None
        snaps = list(self.snapshots)
        first = 0
        for i in range(len(snaps) - 2, -1, -1):  # newest first: the first one old enough is the tightest fit
            if snaps[-1].t - snaps[i].t >= self.window_s:
                first = i
                break
        return snaps[first:]

    def restart_window(self) -> None:
        """Forget every snapshot: the next window starts at the next poll.

        The daemon calls it when a publish or rollback ends (its own or another process's): production
        restarted and served the canary's requests, which are not its users' traffic, and /metrics cannot
        tell them apart, so no window may span them."""
        self.snapshots.clear()

    def close(self) -> None:
        if self.arrivals is not None:
            self.arrivals.close()
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
