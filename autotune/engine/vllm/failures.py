"""The texts by which vLLM says why it failed (checked against vLLM 0.32/0.33).

The root cause is often on stdout behind an ``(EngineCore pid=N) ERROR`` prefix, while stderr
ends with the generic "Engine core initialization failed": the launcher reads both streams.
"""

from __future__ import annotations

import re

from autotune.engine.failures import COMMON_PATTERNS, FailureClass, Patterns

__all__ = ["PATTERNS"]

# Most specific first: an OOM traceback also contains the generic "initialization failed".
_OOM: Patterns = [
    (FailureClass.OOM, re.compile(p))
    for p in (
        r"torch\.OutOfMemoryError",
        r"CUDA out of memory",
        r"No available memory for the cache blocks",
        r"KV cache is needed, which is larger than the available KV cache memory",
        r"on startup is less than desired GPU memory utilization",
        r"less than desired CPU memory utilization",  # vLLM's CPU build: the NUMA node's free memory
        r"Not enough memory|Insufficient memory for KV cache",
    )
]
_INVALID_ARGS: Patterns = [
    (FailureClass.INVALID_ARGS, re.compile(p))
    for p in (
        r"\berror: unrecognized arguments:",
        r"\berror: argument ",
        r"\berror: the following arguments are required",
        r"must be greater than or equal to max_num_seqs",
        r"is smaller than max_model_len",
        r"\bValue error, ",
        r"validation errors? for \w+",  # pydantic's header line; the "Value error" line follows it
    )
]

PATTERNS: Patterns = _OOM + COMMON_PATTERNS + _INVALID_ARGS
