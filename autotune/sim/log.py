"""vLLM's log lines, as vllm-sim prints them about itself.

Every line has vLLM's prefix (the process, ``APIServer`` or ``EngineCore``, its pid, the level,
the time and the source file vLLM would name), so what reads vLLM's logs reads the simulator's.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

__all__ = ["PID", "log"]

PID = os.getpid()


def log(level: str, where: str, message: str, *, proc: str = "APIServer", stream: TextIO | None = None) -> None:
    """One vLLM-style log line: ``(APIServer pid=N) INFO 11-22 10:00:00 [api_server.py] message``."""
    print(
        f"({proc} pid={PID}) {level} {time.strftime('%m-%d %H:%M:%S')} [{where}] {message}",
        file=stream or sys.stdout,
        flush=True,
    )
