"""The asyncio event loop that autotune's HTTP traffic runs on (the replay client, the capture proxy)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["event_loop_factory"]


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop where installed (it comes with vLLM's uvicorn[standard]): about twice the requests per core."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
