"""Self-calibration: vllm-sim's time constants fitted to a host's own measured trials.

A study's trials are the best calibration data a host will ever have: its GPU (or CPU), its model, its
vLLM, its traffic. ``calibrate`` replays every measured load step of those trials in virtual time (the
step's engine args, the study's workload at the step's load, vLLM's scheduler and the step model) and
searches the constants that make the simulator's step metrics (output throughput, and the p95 TTFT, TPOT
and E2E the trial judged its SLOs on) agree with what was measured: CMA-ES on the log of each constant,
since they span decades, with ``fit.log_loss`` as the error (``calibrate`` says why CMA-ES).

What is fitted is the timing, not the memory: the achievable compute and bandwidth fractions, the host's
per-step and per-sequence overhead, the eager-mode launch cost (``GpuProfile``), and the API server's
TTFT floor and per-output-token cost (``perf.FrontEnd``). Start-up and KV capacity stay vllm-sim's own
accounting. The fit is kept per profile and model (``save``/``load``), so a later study on the host
predicts with it (cli/study.py), and is refitted at the end of each study that used it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from autotune.engine.model import ModelShape
from autotune.measure.metrics import summarize
from autotune.sim.config import SimConfig
from autotune.sim.fit import log_loss
from autotune.sim.perf import API_SERVER, FrontEnd
from autotune.sim.profiles import GPUS, GpuProfile
from autotune.sim.startup import plan_startup
from autotune.sim.virtual import SimEngine, simulate
from autotune.workload.trace import Workload

__all__ = ["Calibration", "MeasuredStep", "METRICS", "FITTED", "calibrate", "step_metrics", "load", "save", "path_for"]

# what a trial's step records (measure/session.Step.to_json) and the simulator can say too
METRICS = ("output_throughput", "ttft_p95", "tpot_p95", "e2e_p95")

# the constants a calibration may move, with the bounds of the search (each fitted on its logarithm). The
# bounds are wide on purpose: a CPU host's step overhead is milliseconds where a GPU's is a millisecond.
FITTED: dict[str, tuple[float, float]] = {
    "compute_efficiency": (0.005, 1.0),
    "bandwidth_efficiency": (0.02, 1.0),
    "host_step_s": (1e-4, 0.2),
    "host_seq_s": (1e-7, 2e-3),
    "eager_layer_s": (1e-6, 1e-2),
    "latency_s": (1e-3, 1.0),  # the API server's (perf.FrontEnd)
    "output_token_s": (1e-7, 1e-3),
}
FRONT_END = {f.name for f in fields(FrontEnd) if f.init} - {"free_s", "merge"}  # its time constants
WARMUP = 4  # as the simulator's capacity predictions (rank.py) and the replay client warm up


@dataclass(frozen=True)
class MeasuredStep:
    """One load step of a real trial: the engine args that ran, the load, and what it measured."""

    trial: int
    values: Mapping[str, Any]
    load: float
    measured: Mapping[str, float]  # METRICS that were measured (a step with no latency sample has none)


@dataclass(frozen=True)
class Calibration:
    """A fit of one profile's time constants on one model's trials: what it moved, and how well it fits."""

    profile: str  # vllm-sim's profile key (profiles.GPUS): "cpu", "h100-80gb"
    model: str
    constants: dict[str, float]
    loss_before: float  # log_loss of the uncalibrated profile on the same steps
    loss_after: float
    steps: int
    trials: list[int] = field(default_factory=list)
    study: str = ""
    fitted_at: float = 0.0

    def gpu(self) -> GpuProfile:
        return _gpu_with(GPUS[self.profile], self.constants)

    def front_end(self) -> FrontEnd:
        constants = dict(self.constants)
        if "output_token_s" in constants:
            # a fit from before the per-chunk cost was a constant of its own took output_token_s as a streamed
            # token's whole cost: it keeps that meaning (a fit since stores the chunk_s it was fitted with)
            constants.setdefault("chunk_s", 0.0)
        return _front_end_with(API_SERVER, constants)

    def describe(self) -> str:
        return (
            f"calibrated on {self.steps} steps of {len(self.trials)} trials of study {self.study or '?'} "
            f"(log error {self.loss_before:.3f} -> {self.loss_after:.3f})"
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Calibration:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


def _front_end_with(fe: FrontEnd, constants: Mapping[str, float]) -> FrontEnd:
    """``fe`` with the fitted constants that are the API server's."""
    mine: dict[str, Any] = {k: v for k, v in constants.items() if k in FRONT_END}
    return replace(fe, **mine)


def _gpu_with(base: GpuProfile, constants: Mapping[str, float]) -> GpuProfile:
    """``base`` with those of the fitted constants that are its own (the others are the API server's)."""
    own: dict[str, Any] = {k: v for k, v in constants.items() if k not in FRONT_END}  # float fields, by name
    return replace(base, **own)


def step_metrics(
    shape: ModelShape, gpu: GpuProfile, front_end: FrontEnd, values: Mapping[str, Any], workload: Workload
) -> dict[str, float] | None:
    """What the simulator says one step measures (METRICS), or None for a config it says would not start."""
    config = SimConfig.from_args(values, gpu, shape)
    if config.validate() is not None:
        return None
    start = plan_startup(shape, gpu, config)
    if start.plan is None:
        return None
    s = summarize(simulate(SimEngine(shape, gpu, config, start.plan, front_end), workload, warmup=WARMUP), [])
    got = {
        "output_throughput": s.output_throughput,
        "ttft_p95": s.ttft.p95,
        "tpot_p95": s.tpot.p95,
        "e2e_p95": s.e2e.p95,
    }
    return {k: v for k, v in got.items() if v is not None}


def _pairs(
    steps: Iterable[MeasuredStep], predict: Callable[[MeasuredStep], dict[str, float] | None]
) -> list[tuple[float, float]]:
    pairs = []
    for st in steps:
        got = predict(st)
        for k, m in st.measured.items():
            p = got.get(k) if got else None
            # a config the simulator thinks cannot start, or a metric it cannot produce, is a miss by 10x:
            # an error the search must want to remove, and a finite one
            pairs.append((m, p if p else m * 10))
    # one overloaded step's queueing blow-up must not outweigh everything else: cap each ratio at 10x
    return [(m, min(max(p, m / 10), m * 10)) for m, p in pairs if m > 0]


def calibrate(
    shape: ModelShape,
    profile: str,
    model: str,
    steps: Sequence[MeasuredStep],
    workload_at: Callable[[float], Workload],
    *,
    names: Sequence[str] = tuple(FITTED),
    start: Calibration | None = None,
    evaluations: int = 150,
    seed: int = 0,
    study: str = "",
    good_enough: float = 0.0,
) -> Calibration:
    """Fit ``names`` (of FITTED) of ``profile`` to ``steps``, starting from ``start``'s fit or the profile's own
    values. ``workload_at(load)`` is the study's workload at a load, as the step replayed it.

    CMA-ES (the ``cmaes`` package, Optuna's own CMA-ES engine) on the constants' logarithms: the simulator is a
    discrete-event model, so the loss is piecewise flat and its constants trade off against each other (a
    longer step or a slower API server both raise TPOT); a population-based search copes with both, where a
    one-constant-at-a-time search stalls. ``evaluations`` simulations of every step bound the cost. A start
    whose log error is ``good_enough`` already is kept as it is, for the cost of one simulation of every step.
    """
    import numpy as np
    from cmaes import CMA

    unknown = sorted(set(names) - set(FITTED))
    if unknown:
        raise ValueError(f"cannot fit {', '.join(unknown)}: the constants are {', '.join(FITTED)}")
    base, fe = (start.gpu(), start.front_end()) if start else (GPUS[profile], API_SERVER)
    workloads: dict[float, Workload] = {}

    def workload(load_factor: float) -> Workload:
        key = round(load_factor, 6)
        if key not in workloads:
            workloads[key] = workload_at(load_factor)
        return workloads[key]

    def loss(c: Mapping[str, float]) -> float:
        gpu = _gpu_with(base, c)
        front = _front_end_with(fe, c)
        return log_loss(_pairs(steps, lambda st: step_metrics(shape, gpu, front, st.values, workload(st.load))))

    now = {**asdict(base), **asdict(fe)}
    lo = np.array([math.log(FITTED[k][0]) for k in names])
    hi = np.array([math.log(FITTED[k][1]) for k in names])
    x0 = np.clip(np.array([math.log(max(now[k], 1e-12)) for k in names]), lo, hi)
    best = {k: math.exp(v) for k, v in zip(names, x0, strict=True)}
    before = after = loss(best)
    # a factor of ~3 either way to start with; a warm start from an earlier fit searches closer to it
    opt = CMA(mean=x0, sigma=0.5 if start else 1.0, bounds=np.stack([lo, hi], axis=1), seed=seed)
    done = 1 if before > good_enough else evaluations
    while done < evaluations:
        told = []
        for _ in range(opt.population_size):
            x = opt.ask()
            c = {k: math.exp(v) for k, v in zip(names, x, strict=True)}
            value = loss(c)
            done += 1
            told.append((x, value))
            if value < after:
                best, after = c, value
        opt.tell(told)
        if opt.should_stop():
            break
    kept = {**(start.constants if start else {}), **best}
    if "output_token_s" in kept:
        kept["chunk_s"] = fe.chunk_s  # what the fitted per-token cost is on top of (Calibration.front_end)
    return Calibration(
        profile, model, kept, before, after, len(steps), sorted({s.trial for s in steps}), study, time.time()
    )


def _slug(model: str) -> str:
    """A model's file name: a local directory by its own name, a hub id with its slash spelled out."""
    p = Path(model)
    name = p.name if p.is_dir() else model.strip("/")
    return "".join(c if c.isalnum() or c in "-._" else "--" for c in name) or "model"


def path_for(root: Path, profile: str, model: str) -> Path:
    return Path(root) / "calibration" / profile / f"{_slug(model)}.json"


def save(cal: Calibration, root: Path) -> Path:
    from autotune.locations import atomic_write

    path = path_for(root, cal.profile, cal.model)
    atomic_write(path, json.dumps(cal.to_json(), indent=1), 0o644)
    return path


def load(root: Path, profile: str, model: str) -> Calibration | None:
    """The host's calibration for this profile and model, or None (none yet, or a file that does not parse)."""
    path = path_for(root, profile, model)
    try:
        return Calibration.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None
