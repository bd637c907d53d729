"""A search truth read from a file, so that truths can come from outside the simulator (``bench_search.py
--truth-file F``).

The file is JSON Lines. Its first line says what is served and judged, as bench_search's scenarios do::

    {"truth": "hand-chat-8b-l20", "scenario": {"name": "hand-chat-8b-l20", "model": "llama-3.1-8b",
     "gpu": "l20-48gb", "tp": 1, "max_model_len": 8192, "slos": ["ttft<800ms", "tpot<60ms"],
     "workload": "chat", "rate": 4.0, "requests": 200}}

Every other line is one config: its engine args (any subset of the searched knobs), whether it starts and in how
many seconds, and, where it starts, its expected metrics at each offered rate (req/s, ascending)::

    {"config": {"max_num_seqs": 256, "max_num_batched_tokens": 2048}, "starts": true, "start_s": 95,
     "steps": [{"rps": 2.0, "ttft": 0.21, "tpot": 0.031, "output_throughput": 410}, ...]}
    {"config": {"max_num_seqs": 1024, "gpu_memory_utilization": 0.95}, "starts": false, "start_s": 40,
     "failure": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"}

- A latency (``ttft``, ``tpot``, ``itl``, ``e2e``, seconds) is the value the scenario's SLO on it judges (its
  percentile): every percentile of the step reads that value. ``output_throughput`` (tok/s) is optional.
- A measured config is answered by the file's nearest config: distance over the knobs the file's configs name
  (log scale for counts, normalised by the file's range; any difference in a flag or a choice counts 1). A knob no
  config names is inert: it moves nothing.
- Between two steps a metric is interpolated in log rate and log value; below the first step it is the first's,
  and above the last it is the last's (so the last step of a config that starts must miss an SLO).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LATENCIES = ("ttft", "tpot", "itl", "e2e")


class TruthFileError(ValueError):
    """A truth file that cannot be read: one line saying where and what to change."""


@dataclass(frozen=True)
class Row:
    config: dict[str, Any]
    starts: bool
    start_s: float
    failure: str = ""
    steps: tuple[tuple[float, dict[str, float]], ...] = ()  # (req/s, metrics), ascending

    def metrics_at(self, rps: float) -> dict[str, float]:
        """The expected metrics at ``rps`` (log-log interpolation; held flat outside the tabulated rates)."""
        assert self.steps, "a config that does not start has no metrics"
        if rps <= self.steps[0][0]:
            return dict(self.steps[0][1])
        for (r0, m0), (r1, m1) in itertools.pairwise(self.steps):
            if rps == r1:
                return dict(m1)
            if rps < r1:
                w = (math.log(rps) - math.log(r0)) / (math.log(r1) - math.log(r0))
                return {k: _between(m0[k], m1[k], w) for k in m0 if k in m1}
        return dict(self.steps[-1][1])

    def capacity(self, holds: Callable[[dict[str, float]], bool]) -> float:
        """The highest rate at which the expected metrics hold (``holds``), to 0.1 % (0: not even the first step,
        or the config does not start)."""
        if not self.starts or not holds(self.metrics_at(self.steps[0][0])):
            return 0.0
        lo = next((r for r, m in reversed(self.steps) if holds(m)), self.steps[0][0])
        above = [r for r, _ in self.steps if r > lo]
        if not above:
            return lo
        hi = above[0]
        while hi / lo > 1.001:
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if holds(self.metrics_at(mid)) else (lo, mid)
        return lo


def _between(a: float, b: float, w: float) -> float:
    if a > 0 and b > 0:
        return math.exp(math.log(a) + w * (math.log(b) - math.log(a)))
    return a + w * (b - a)


@dataclass(frozen=True)
class TruthFile:
    name: str
    scenario: dict[str, Any]
    rows: tuple[Row, ...]

    def nearest(self, values: dict[str, Any]) -> Row:
        """The file's config nearest to ``values`` (the first of equals, in file order)."""
        knobs = sorted({k for r in self.rows for k in r.config})
        spans = {}
        for k in knobs:
            xs = [r.config[k] for r in self.rows if k in r.config]
            if all(_count(x) for x in xs):
                logs = [math.log(x) for x in xs]
                spans[k] = (max(logs) - min(logs)) or 1.0

        def distance(row: Row) -> float:
            d = 0.0
            for k in knobs:
                a, b = values.get(k), row.config.get(k)
                if a is None or b is None:
                    d += 0.0 if a is b else 1.0
                elif k in spans and _count(a):
                    d += abs(math.log(a) - math.log(b)) / spans[k]
                else:
                    d += float(a != b)
            return d

        return min(self.rows, key=distance)


def _count(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x > 0


def read(path: Path, judged: Callable[[Sequence[str]], Callable[[dict[str, float]], bool]]) -> TruthFile:
    """The truth in ``path``; ``judged(slos)`` gives the test of a step's metrics against the file's SLOs, used to
    check that every config that starts misses one at its last step."""
    try:
        lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    except OSError as e:
        raise TruthFileError(f"cannot read the truth file {path}: {e.strerror}") from e
    if not lines:
        raise TruthFileError(
            f"{path} is empty; its first line names the truth and its scenario (see scripts/truth_file.py)"
        )

    def parse(n: int, line: str) -> dict[str, Any]:
        try:
            out = json.loads(line)
        except json.JSONDecodeError as e:
            raise TruthFileError(f"{path}:{n}: not JSON ({e.msg}); each line is one JSON object") from e
        if not isinstance(out, dict):
            raise TruthFileError(f"{path}:{n}: a line is one JSON object, got {type(out).__name__}")
        return out

    head = parse(*lines[0])
    if not isinstance(head.get("truth"), str) or not isinstance(head.get("scenario"), dict):
        raise TruthFileError(
            f"{path}:{lines[0][0]}: the first line must be "
            '{"truth": NAME, "scenario": {...}}; see scripts/truth_file.py'
        )
    holds = judged(head["scenario"].get("slos", []))
    rows = tuple(_row(path, n, parse(n, line), holds) for n, line in lines[1:])
    if not rows:
        raise TruthFileError(f"{path} has no config lines after its header")
    return TruthFile(head["truth"], head["scenario"], rows)


def _row(path: Path, n: int, d: dict[str, Any], holds: Callable[[dict[str, float]], bool]) -> Row:
    where = f"{path}:{n}"
    if not isinstance(d.get("config"), dict) or not isinstance(d.get("starts"), bool):
        raise TruthFileError(f'{where}: a config line needs "config" (an object) and "starts" (true or false)')
    start_s = d.get("start_s")
    if not isinstance(start_s, int | float) or start_s <= 0:
        raise TruthFileError(f'{where}: "start_s" must be the start-up\'s seconds (> 0), got {start_s!r}')
    if not d["starts"]:
        return Row(d["config"], False, float(start_s), str(d.get("failure", "the engine exited during start-up")))
    steps = []
    for s in d.get("steps") or []:
        rps = s.get("rps") if isinstance(s, dict) else None
        if not isinstance(rps, int | float) or rps <= 0:
            raise TruthFileError(f'{where}: each step needs "rps" > 0 (the offered req/s), got {s!r}')
        metrics = {k: float(v) for k, v in s.items() if k != "rps"}
        if not any(k in metrics for k in LATENCIES):
            raise TruthFileError(f"{where}: the step at {rps:g} req/s states no latency ({', '.join(LATENCIES)})")
        steps.append((float(rps), metrics))
    if not steps:
        raise TruthFileError(f'{where}: a config that starts needs "steps"')
    if any(b[0] <= a[0] for a, b in itertools.pairwise(steps)):
        raise TruthFileError(f'{where}: steps must be in ascending "rps"')
    if holds(steps[-1][1]):
        raise TruthFileError(
            f"{where}: its last step ({steps[-1][0]:g} req/s) meets every SLO, so its capacity "
            f"is unknown; add a step at a rate where one is missed"
        )
    return Row(d["config"], True, float(start_s), "", tuple(steps))
