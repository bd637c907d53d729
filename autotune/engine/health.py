"""One ``GET /health``: the probe every part of autotune asks whether an engine (or the proxy before it) serves.

vLLM answers 200 once its engine is built and 503 once the engine is dead; the port refuses connections
before that. ``probe`` asks once and never raises: a server that does not answer is a ``Health`` whose
``error`` names why (the httpx exception's name). The loops around it (wait until ready, wait until a proxy
serves through a backend) stay with their callers, which know their deadlines.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

__all__ = ["Health", "probe"]


@dataclass(frozen=True)
class Health:
    url: str  # the server's base URL
    status: int | None  # the HTTP status of /health; None: no answer
    error: str = ""  # why there was no answer (ConnectError, ReadTimeout, ...)
    served_by: str | None = None  # the value of the response header asked for (a proxy's upstream), if any

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def said(self) -> str:
        """What it answered, in a few words: ``HTTP 503``, or the error's name."""
        return f"HTTP {self.status}" if self.status is not None else self.error


def probe(url: str, *, client: httpx.Client | None = None, timeout: float | None = None, header: str = "") -> Health:
    """GET ``url``/health once, on ``client`` (at its own timeout unless one is given) or on a connection of its own
    (5 s; never through a proxy from the environment: autotune talks to its own engines and production directly)."""
    target = url.rstrip("/") + "/health"
    try:
        if client is None:
            with httpx.Client(timeout=5.0 if timeout is None else timeout, trust_env=False) as own:
                r = own.get(target)
        elif timeout is None:
            r = client.get(target)
        else:
            r = client.get(target, timeout=timeout)
    except httpx.HTTPError as e:
        return Health(url, None, type(e).__name__)
    return Health(url, r.status_code, served_by=r.headers.get(header) if header else None)
