"""GPU memory through NVML (nvidia-ml-py). Every function is a no-op answer where NVML sees no GPU."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

try:
    import pynvml
except ImportError:  # pragma: no cover - nvidia-ml-py is a dependency, but be calm without it
    pynvml = None

__all__ = ["GpuInfo", "devices", "pids_on_gpu", "wait_released"]


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    total_bytes: int
    free_bytes: int


def _init() -> bool:
    if pynvml is None:
        return False
    try:
        pynvml.nvmlInit()
        return True
    except Exception:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...: whatever fails, no GPU here
        return False


def devices() -> list[GpuInfo]:
    if not _init():
        return []
    out = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        name = pynvml.nvmlDeviceGetName(h)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        out.append(GpuInfo(i, name.decode() if isinstance(name, bytes) else name, int(mem.total), int(mem.free)))
    return out


def pids_on_gpu() -> set[int] | None:
    """PIDs holding GPU memory on any device; None when NVML is not available."""
    if not _init():
        return None
    pids: set[int] = set()
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        for getter in (pynvml.nvmlDeviceGetComputeRunningProcesses, pynvml.nvmlDeviceGetGraphicsRunningProcesses):
            # a query the driver or device does not support raises (NVMLError_NotSupported, ...): no pids from it
            with contextlib.suppress(Exception):
                pids.update(p.pid for p in getter(h))
    return pids


def wait_released(pids: set[int], timeout: float = 30.0, interval: float = 0.25) -> bool:
    """Wait until none of ``pids`` holds GPU memory. True when released (or no GPU to watch)."""
    deadline = time.monotonic() + timeout
    while True:
        held = pids_on_gpu()
        if held is None or not (held & pids):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
