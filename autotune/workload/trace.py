"""Workloads: what requests arrive when, and the files they are kept in.

autotune's trace format is JSON Lines, one request per line, ordered by arrival:

    {"arrival_s": 0.0,  "prompt_tokens": 1536, "output_tokens": 128, "prefix_group": "bot", "prefix_tokens": 1024}
    {"arrival_s": 0.31, "prompt": "Summarise the following ...", "output_tokens": 256, "api": "chat"}

    arrival_s       seconds after the start of the trace (required)
    prompt          the prompt text; or
    prompt_tokens   its length in the model's tokens (the text is built with the model's tokenizer)
    output_tokens   tokens to generate (sent as max_tokens with ignore_eos, so lengths follow the trace)
    prefix_group    optional: requests with the same group share their first prefix_tokens tokens
                    (a system prompt, a document): what prefix caching feeds on
    prefix_tokens   length of that shared prefix, included in prompt_tokens
    api             "completion" (default) or "chat"

Also read: ``vllm bench serve``'s custom JSONL (``{"prompt": ..., "output_tokens": ...}``, no
arrival times) and ShareGPT JSON (a list of ``{"conversations": [{"from", "value"}, ...]}``).
Files without arrival times get them from ``with_arrivals`` (Poisson or gamma at a rate).

A ShareGPT conversation gives one request: its first user turn (``human`` or ``user``) that the
model answers (``gpt`` or ``assistant``) in the next turn; system turns are context, never the
prompt. Conversations without such an exchange (a question left unanswered, only the model
speaking) or with an empty one are skipped, and ``Workload.skipped`` counts them.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np

from autotune.errors import TraceFormatError

__all__ = ["Request", "Workload", "read_workload", "write_trace", "with_arrivals", "gamma_arrivals", "MAX_TOKENS"]

Api = Literal["completion", "chat"]
MAX_TOKENS = 1 << 24  # no model reads or writes more in one request; a larger count is a mistake
_FIELDS = {"arrival_s", "prompt", "prompt_tokens", "output_tokens", "prefix_group", "prefix_tokens", "api", "prefix"}


@dataclass(frozen=True)
class Request:
    arrival_s: float
    output_tokens: int
    prompt: str | None = None  # the request's own text (after the shared prefix, if any)
    prompt_tokens: int | None = None  # whole prompt, prefix included
    prefix_group: str | None = None
    prefix_tokens: int = 0
    prefix: str | None = None  # the shared prefix's text, once built
    api: Api = "completion"

    @property
    def has_text(self) -> bool:
        return self.prompt is not None and (self.prefix_tokens == 0 or self.prefix is not None)

    def to_json(self) -> dict[str, object]:
        d = {k: v for k, v in asdict(self).items() if v is not None}
        if d.get("prefix_tokens") == 0:
            d.pop("prefix_tokens")
        if d.get("api") == "completion":
            d.pop("api")
        return d


@dataclass(frozen=True)
class Workload:
    requests: tuple[Request, ...]
    name: str = "workload"
    skipped: int = 0  # entries of the file read that gave no request (ShareGPT conversations without an exchange)
    # the rate this workload stands for when it was drawn at one (a load step: the base rate x the load);
    # a few requests' own arrivals say little about it (5 Poisson arrivals in 2 s can span 0.6 s)
    offered_rate: float | None = None

    def __post_init__(self) -> None:
        if not self.requests:
            raise TraceFormatError(f"workload {self.name!r} has no requests")

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def span_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    @property
    def rate(self) -> float:
        """Mean arrival rate in requests/s (inf when everything arrives at once)."""
        span = self.span_s
        return (len(self.requests) - 1) / span if span > 0 else math.inf

    @property
    def load_rate(self) -> float:
        """The rate a load step offers: ``offered_rate`` when it was drawn at one, else its arrivals' mean."""
        return self.offered_rate if self.offered_rate is not None else self.rate

    def scaled(self, load: float) -> Workload:
        """The same requests arriving ``load`` times as fast (load 2: twice the rate)."""
        if load <= 0:
            raise ValueError("load factor must be positive")
        t0 = self.requests[0].arrival_s
        return replace(self, requests=tuple(replace(r, arrival_s=(r.arrival_s - t0) / load) for r in self.requests))

    def head(self, n: int) -> Workload:
        return replace(self, requests=self.requests[:n])


def gamma_arrivals(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Arrival times like ``vllm bench serve``: gamma gaps with shape=burstiness (1 = Poisson)."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return [float(t) for t in np.cumsum(gaps)]


def with_arrivals(
    requests: Iterable[Request], rate: float, burstiness: float = 1.0, seed: int = 0, name: str = "workload"
) -> Workload:
    reqs = list(requests)
    times = gamma_arrivals(len(reqs), rate, burstiness, seed)
    return Workload(tuple(replace(r, arrival_s=t) for r, t in zip(reqs, times, strict=True)), name)


def write_trace(workload: Workload, path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in workload.requests:
            f.write(json.dumps(r.to_json(), ensure_ascii=False) + "\n")


# --- readers -------------------------------------------------------------------------------

TokenCounter = Callable[[str], int]


def read_workload(
    path: str | Path,
    *,
    rate: float | None = None,
    burstiness: float = 1.0,
    seed: int = 0,
    count_tokens: TokenCounter | None = None,
    output_tokens: int | None = None,
    api: Api | None = None,
    limit: int | None = None,
) -> Workload:
    """Read any supported file. Files without arrival times need ``rate``.

    ShareGPT's output lengths come from its answers, counted with ``count_tokens`` (the
    model's tokenizer) unless ``output_tokens`` fixes them.
    """
    p = Path(path)
    if not p.is_file():
        raise TraceFormatError(f"workload file {str(p)!r} does not exist")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise TraceFormatError(
            f"{p}: not UTF-8 text (byte {e.object[e.start : e.start + 1]!r} at offset {e.start}); save it as UTF-8"
        ) from e
    stripped = text.lstrip()
    skipped = 0
    if stripped.startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from e
        reqs, skipped = _read_sharegpt(data, p, count_tokens, output_tokens)
        timed = False
    else:
        rows = _jsonl_rows(text, p)
        timed = all("arrival_s" in row for _, row in rows)
        if not timed and any("arrival_s" in row for _, row in rows):
            line = next(n for n, row in rows if "arrival_s" not in row)
            raise TraceFormatError(f"{p}:{line}: arrival_s is missing here but present on other lines")
        reqs = [_request_from_row(row, p, n, timed, output_tokens) for n, row in rows]
    if limit is not None:
        reqs = reqs[:limit]
    if api is not None:
        reqs = [replace(r, api=api) for r in reqs]
    if not reqs:
        raise TraceFormatError(
            f"{p}: no requests in the file" + (f" ({skipped} conversations skipped: {SKIPPED_WHY})" if skipped else "")
        )
    if timed and rate is None:
        reqs.sort(key=lambda r: r.arrival_s)
        return Workload(tuple(reqs), p.stem)
    if rate is None:
        raise TraceFormatError(f"{p} has no arrival times; give a request rate (e.g. --rate 4)")
    return replace(with_arrivals(reqs, rate, burstiness, seed, name=p.stem), skipped=skipped)


def _jsonl_rows(text: str, p: Path) -> list[tuple[int, dict]]:
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"{p}:{n}: not valid JSON ({e.msg}); one JSON object per line expected") from e
        if not isinstance(row, dict):
            raise TraceFormatError(f"{p}:{n}: expected a JSON object, got {type(row).__name__}")
        rows.append((n, row))
    return rows


def _positive_int(row: dict, key: str, where: str, minimum: int = 1) -> int:
    v = row[key]
    if isinstance(v, bool) or (not isinstance(v, int) and not (isinstance(v, float) and v.is_integer())):
        raise TraceFormatError(f"{where}: {key} must be an integer, got {v!r}")
    if int(v) < minimum:
        raise TraceFormatError(f"{where}: {key} must be >= {minimum}, got {v}")
    if int(v) > MAX_TOKENS:
        raise TraceFormatError(f"{where}: {key} must be <= {MAX_TOKENS} (no model takes more), got {v}")
    return int(v)


def _request_from_row(row: dict, p: Path, n: int, timed: bool, output_tokens: int | None) -> Request:
    where = f"{p}:{n}"
    unknown = set(row) - _FIELDS
    if unknown and timed:
        raise TraceFormatError(
            f"{where}: unknown field(s) {', '.join(sorted(unknown))}; see the trace format in docs/study-file.md"
        )
    prompt = row.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise TraceFormatError(f"{where}: prompt must be a string")
    prompt_tokens = _positive_int(row, "prompt_tokens", where) if "prompt_tokens" in row else None
    if prompt is None and prompt_tokens is None:
        raise TraceFormatError(f"{where}: each request needs prompt (text) or prompt_tokens (a count)")
    if output_tokens is not None:
        out = output_tokens
    elif "output_tokens" in row:
        out = _positive_int(row, "output_tokens", where)
    else:
        raise TraceFormatError(f"{where}: output_tokens is missing (or pass a fixed output length)")
    arrival = 0.0
    if timed:
        a = row["arrival_s"]
        if not isinstance(a, (int, float)) or isinstance(a, bool) or a < 0 or not math.isfinite(a):
            raise TraceFormatError(f"{where}: arrival_s must be a number >= 0, got {a!r}")
        arrival = float(a)
    group = row.get("prefix_group")
    prefix_tokens = _positive_int(row, "prefix_tokens", where, 0) if "prefix_tokens" in row else 0
    if prefix_tokens and group is None:
        raise TraceFormatError(f"{where}: prefix_tokens needs a prefix_group to share it with")
    if group is not None and prefix_tokens == 0:
        raise TraceFormatError(f"{where}: prefix_group {group!r} needs prefix_tokens > 0")
    if prompt_tokens is not None and prefix_tokens >= prompt_tokens:
        raise TraceFormatError(
            f"{where}: prefix_tokens ({prefix_tokens}) must be below prompt_tokens ({prompt_tokens})"
        )
    api = row.get("api", "completion")
    if api not in ("completion", "chat"):
        raise TraceFormatError(f"{where}: api must be 'completion' or 'chat', got {api!r}")
    if row.get("prefix") is not None and not isinstance(row["prefix"], str):
        raise TraceFormatError(f"{where}: prefix must be a string (the shared prefix's text)")
    return Request(
        arrival_s=arrival,
        output_tokens=out,
        prompt=prompt,
        prompt_tokens=prompt_tokens,
        prefix_group=None if group is None else str(group),
        prefix_tokens=prefix_tokens,
        prefix=row.get("prefix"),
        api=api,
    )


_ASKS = frozenset({"human", "user"})
_ANSWERS = frozenset({"gpt", "assistant"})
SKIPPED_WHY = "no user turn answered by the model, or an empty one"


def _exchange(turns: list, where: str) -> tuple[str, str] | None:
    """The first user turn the model answers in the next turn, and that answer; system turns set no prompt."""
    spoken = []
    for j, turn in enumerate(turns):
        if (
            not isinstance(turn, dict)
            or not isinstance(turn.get("from"), str)
            or not isinstance(turn.get("value"), str)
        ):
            raise TraceFormatError(f'{where}: turn {j} must be {{"from": ROLE, "value": TEXT}}')
        if turn["from"] != "system":
            spoken.append(turn)
    for ask, answer in itertools.pairwise(spoken):
        if ask["from"] in _ASKS and answer["from"] in _ANSWERS:
            return ask["value"], answer["value"]
    return None


def _read_sharegpt(
    data: object, p: Path, count_tokens: TokenCounter | None, output_tokens: int | None
) -> tuple[list[Request], int]:
    """One request per conversation with an exchange; and how many conversations had none."""
    if not isinstance(data, list):
        raise TraceFormatError(f"{p}: ShareGPT files are a JSON list of conversations")
    if output_tokens is None and count_tokens is None:
        raise TraceFormatError(f"{p}: ShareGPT output lengths need the model's tokenizer (or a fixed output length)")
    reqs, skipped = [], 0
    for i, entry in enumerate(data):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            raise TraceFormatError(f"{p}: entry {i} has no 'conversations' list; is this ShareGPT?")
        pair = _exchange(turns, f"{p}: entry {i}")
        # an unanswered question has no output length: vLLM's benchmark skips it too
        if pair is None:
            out = 0
        elif output_tokens is not None:
            out = output_tokens
        else:
            assert count_tokens is not None  # one of the two is given: checked above
            out = count_tokens(pair[1])
        if pair is None or not pair[0] or out < 1:
            skipped += 1
            continue
        reqs.append(Request(arrival_s=0.0, output_tokens=out, prompt=pair[0], api="chat"))
    return reqs, skipped
