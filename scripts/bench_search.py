"""GPU-hours until autotune and its peers hand a user a near-optimal vLLM config, on truths that differ from the
simulator autotune searches with, in form and not only in constants.

For each scenario (model, GPU, workload, SLOs) and seed:

1. **The truth** (``Truth``): vllm-sim with other constants than the ones autotune ships (each uncertain time
   constant drawn log-normally within the fidelity table's held-out error, ``SIGMA``) and with terms the guide
   does not have (``Form``, sized from evidence, never fitted here): each knob's values (max_num_seqs,
   max_num_batched_tokens, chunked prefill, prefix caching) change the step time along a trend of their own
   sign; a memory plan with another activation peak and a fragmented KV pool (some configs the guide expects to
   start fail, and some it expects to fail start); a start-up of another length; attention slower at long
   contexts (strongly on Hopper, issue 26's evidence); a cost per preempted request; an API server that pays
   2-20 ms per request. An **adversarial** truth (``--adversarial``) also reverses the marginal effect of the
   knob the guide says matters most. A config's **expected capacity** is the highest load (4.4 % apart) at
   which the truth meets every SLO without noise; the **optimum** is the best over the grid below
   (``truth_table``, cached under bench/search-truth/).
2. **Every measurement draws its own noise**: a run's speed is a few percent off, and one run in twenty stalls
   (``measurement_speed``), as common random numbers: the k-th measurement of a config draws the same speed in
   every strategy's run. Measuring a config again draws again, which is what re-measurement narrows. A truth can
   also come from a file (``--truth-file``, scripts/truth_file.py): a lookup of its expected metrics instead.
3. **The strategies** measure configs only through the truth, as a GPU would answer (``TruthGpu.measure``,
   standing in for autotune's one measurement function; start-ups cost their time, failed ones too):
   - **autotune**: the real ``StudyRun`` as ``autotune study`` sets it up on a GPU host (baselines, simulate
     first with the *shipped* calibration, refit on every trial, race the incumbent, TPE once the simulator
     stops), then its re-measurement of the top two and the best baseline until its verdict is sure;
   - **TPE**: the same runner without the simulator or the race, re-measurement included; **random**: Optuna's
     random sampler, no baselines (so nothing to re-measure against);
   - **auto_tune grid**: vLLM's benchmarks/auto_tune.sh: the highest gpu_memory_utilization that starts (found
     top down by failed starts), then max_num_seqs x max_num_batched_tokens in list order;
   - **bench sweep grid**: ``vllm bench sweep serve`` with the staircase list of vLLM's docs
     (https://docs.vllm.ai/en/latest/benchmarking/sweeps/), continued.
4. **The score is what a user is handed.** After each trial a strategy declares a winner as it would for a user
   (a study: its winner, best.yaml's config; a grid: its best measurement). Per run: the curve of the declared
   config's expected capacity (share of the optimum, 1 % resolution) against GPU-hours, and the GPU-hours and
   trials until the declared config is within 95 % of the optimum and stays there to the run's end. The CPU
   seconds autotune's simulator spends between trials count as GPU time (the study holds its GPU).
5. **The circularity check**, per truth: Spearman of the guide's predicted capacity against the truth's expected
   one over the grid, the start-ups they disagree on, and where the guide's first pick lands. bench/
   sim_fidelity.md measures the same on public vLLM groups (Spearman median +0.94, first pick within 5 % in 25
   of 27 groups): a truth family that is fit for purpose lands near that, the adversarial one below it.

A config the search samples between grid points is measured as its nearest grid point (log scale for counts):
the truth is tabulated. enforce_eager stays off (CUDA graphs); block size stays at vLLM's default.

    .venv/bin/python scripts/bench_search.py --seeds 3 --json bench/search-runs.json --plot docs/search-curves.png
    .venv/bin/python scripts/bench_search.py --adversarial --seeds 1 --strategy autotune --strategy TPE ...
    .venv/bin/python scripts/bench_search.py --survey       # the truths only: optimum, defaults, circularity
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import optuna

from autotune.engine.args import EngineArgs
from autotune.engine.command import CheckedArgs, EngineCommand
from autotune.engine.failures import LogWatch, classify_exit
from autotune.engine.flags import FlagTable
from autotune.engine.vllm.defaults import default_batching
from autotune.engine.vllm.failures import PATTERNS
from autotune.measure.metrics import Summary, summarize
from autotune.measure.profiles import LoadProfile
from autotune.measure.session import Outcome, Step
from autotune.measure.slo import SLO
from autotune.sim.config import SimConfig
from autotune.sim.perf import API_SERVER, FrontEnd, StepModel
from autotune.sim.profiles import GpuProfile, gpu_profile, model_shape
from autotune.sim.rank import highest_holding
from autotune.sim.scheduler import StepPlan
from autotune.sim.startup import Startup, plan_startup
from autotune.sim.virtual import SimEngine, simulate
from autotune.study.advisor import Advisor
from autotune.workload.source import LoadSteps
from autotune.workload.synth import SCENARIOS as WORKLOADS
from autotune.workload.synth import synthesize

sys.path.insert(0, str(Path(__file__).resolve().parent))
import search_scores
import truth_file

ROOT = Path(__file__).resolve().parent.parent
TARGET = 0.95
STEP_S = 60.0  # a load step, as the example studies run it
MAX_STEPS = 4
STOP_S = 5.0  # stopping an engine
MAX_REQUESTS = 400  # a step's requests in virtual time (the product's own cap for predictions)
GRID = 16  # the truth's loads are 2 ** (k / GRID): 4.4 % apart

# The truth's constants spread (log-normal sigma per constant) around the shipped ones: a constant off by 30 % is one
# sigma, the size of the fidelity table's held-out errors (bench/sim_fidelity.md: throughput 19-24 %, TPOT 33-40 %).
SIGMA = math.log(1.3)
GPU_DRAWN = ("bandwidth_efficiency", "compute_efficiency", "attention_bandwidth_efficiency",
             "attention_compute_efficiency", "host_step_s", "host_seq_s", "allreduce_latency_s")
FRONT_DRAWN = ("prompt_token_s", "output_token_s", "latency_s")
_SHARES = {"bandwidth_efficiency", "compute_efficiency", "attention_bandwidth_efficiency",
           "attention_compute_efficiency"}
# The truth's form (``draw_form``). Each size names its evidence; none is fitted to this benchmark's results.
KNOB_SLOPE = 0.05  # a knob's trend across its grid, log step time: the public groups' knob effects are off by
#                    1.06x at the median (bench/sim_fidelity.md, issue 29); Student-t (3 df) for the 1.8x worst
KNOB_JITTER = 0.02  # each grid value's own deviation around the trend
LONG_CONTEXT = 32768  # the context at which ``Form.long_context`` applies in full
# step time x (1 + this) at a 32K context: the public H100 runs of 32K prompts reach ~36 % of peak FLOPs where the
# simulator assumes 51-71 % (1.4-2x); the same lab's A100 runs are within 6-13 % (issue 26)
LONG_CONTEXT_HOPPER, LONG_CONTEXT_OTHER = 0.5, 0.1
ACTIVATION_SIGMA = math.log(1.5)  # the profile run's peak: the guide's estimate has never been checked on a GPU
FRAGMENTATION = 0.03  # at most this share of the GPU lost to the KV cache (allocator fragmentation, other processes)
# the API server's per-request cost: between ours (2.3 ms, measured on this machine's CPU) and the public short-request
# bursts' ~20 ms of wall time per request outside the GPU (issue 26)
REQUEST_S = (2.34e-3, 20e-3)
PREEMPT_S = 5e-3  # per preempted request, beyond its recompute (median; log-normal, sigma ln 2): no public figure
FLIP = 2.0  # an adversarial truth: the guide's marginal effect of one knob, times 1 - FLIP (reversed)
ADVERSARIAL = 1000  # seeds from here are adversarial
# Noise per measurement: a run's speed is exp(N(0, MEASURE_SD)), and one run in STALL_P also stalls (a busy host,
# a throttled GPU) to a speed drawn in STALL. Measuring again draws again.
MEASURE_SD = 0.03
STALL_P, STALL = 0.05, (0.6, 0.9)
TRUTH_VERSION = 3  # the truth's form: cached tables of another version are computed again

UTILIZATIONS = (0.85, 0.90, 0.95)
SEQS = (32, 64, 128, 256, 512, 1024)
TOKENS = (2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class Scenario:
    name: str
    model: str  # a shape vllm-sim knows
    gpu: str  # a vllm-sim profile
    tp: int
    max_model_len: int
    slos: tuple[str, ...]
    workload: str  # a synthetic scenario (workload/synth.py)
    rate: float  # req/s at load 1
    requests: int  # the base workload: a step replays these, repeated
    overrides: tuple[tuple[str, tuple[int, int]], ...] = ()  # the workload's token ranges

    @property
    def gpus(self) -> int:
        return self.tp


SCENARIOS = (
    Scenario("chat-8b-l20", "llama-3.1-8b", "l20-48gb", 1, 8192, ("ttft<800ms", "tpot<60ms"), "chat", 4.0, 200),
    Scenario("long-docs-32b-h100", "qwen2.5-32b", "h100-80gb", 1, 16384, ("ttft<3s", "tpot<80ms"),
             "long-docs", 0.4, 60),
    Scenario("high-concurrency-70b-tp4-a100", "llama-3.1-70b", "a100-80gb", 4, 8192, ("ttft<500ms", "tpot<60ms"),
             "high-concurrency", 20.0, 300),
    Scenario("long-docs-70b-tp4-h100", "llama-3.1-70b", "h100-80gb", 4, 16384, ("ttft<3s", "tpot<50ms"),
             "long-docs", 1.0, 60),
    Scenario("long-context-8b-a10", "llama-3.1-8b", "a10-24gb", 1, 32768, ("ttft<5s", "tpot<100ms"),
             "long-docs", 0.2, 60, (("prompt_tokens", (4096, 16384)),)),
    Scenario("prefix-chat-8b-h100", "llama-3.1-8b", "h100-80gb", 1, 16384, ("ttft<500ms", "tpot<30ms"),
             "chat", 10.0, 300, (("prefix_tokens", (4096, 8192)),)),
    # retrieval-augmented chat: 1-8K-token prompts under a tight TPOT, where a large prefill chunk stalls decodes
    Scenario("rag-8b-h100", "llama-3.1-8b", "h100-80gb", 1, 16384, ("ttft<2s", "tpot<25ms"), "long-docs", 2.0, 100),
)


# --- the space and its grid -------------------------------------------------------------------------------------

def study_text(sc: Scenario, name: str, root: Path, *, sampler: str, race: bool, baselines: bool,
               budget: int, seed: int) -> str:
    """The study file a user would write for the scenario (the CUDA default space, on the truth's grid's ranges)."""
    gpu = gpu_profile(sc.gpu)
    seqs, tokens = default_batching("cuda", gpu.memory_bytes / (1 << 30), gpu.name)
    wl = "".join(f"{k} = [{lo}, {hi}]\n" for k, (lo, hi) in sc.overrides)
    builtin = '["vllm-defaults", "xinference-4.1", "xinference-legacy"]' if baselines else "[]"
    return f"""
name = "{name}"
slos = {json.dumps(list(sc.slos))}
seed = {seed}
sampler = "{sampler}"
storage = "sqlite:///{root}/studies.db"
runs_dir = "{root}"

[engine]
command = "vllm-sim --gpu {sc.gpu} serve"
model = "{sc.model}"
platform = "cuda"

[engine.args]
max_model_len = {sc.max_model_len}
tensor_parallel_size = {sc.tp}

[space]
gpu_memory_utilization = {{ type = "float", low = 0.85, high = 0.95, step = 0.05, default = 0.9 }}
max_num_seqs = {{ type = "int", low = 32, high = 1024, log = true, default = {seqs} }}
max_num_batched_tokens = {{ type = "int", low = 2048, high = 16384, log = true, default = {tokens} }}
enable_chunked_prefill = {{ type = "bool", default = true }}
enable_prefix_caching = {{ type = "bool", default = true }}

[workload]
scenario = "{sc.workload}"
rate = {sc.rate}
requests = {sc.requests}
{wl}
[objective]
max_steps = {MAX_STEPS}
step_duration = "{int(STEP_S)}s"
race = {str(race).lower()}

[budget]
trials = {budget}

[baselines]
builtin = {builtin}
"""


def snap(values: dict[str, Any]) -> dict[str, Any]:
    """A point onto the truth's grid (nearest; log scale for counts)."""
    out = dict(values)
    u = values["gpu_memory_utilization"]
    if UTILIZATIONS[0] - 0.025 <= u <= UTILIZATIONS[-1] + 0.025:  # a baseline's 0.7 stays 0.7 (its own row)
        out["gpu_memory_utilization"] = min(UTILIZATIONS, key=lambda g: abs(g - u))
    for name, grid in (("max_num_seqs", SEQS), ("max_num_batched_tokens", TOKENS)):
        out[name] = min(grid, key=lambda g: abs(math.log(g) - math.log(values[name])))
    return out


def _rules(sc: Scenario, values: dict[str, Any]) -> dict[str, Any]:
    """vLLM's rules (engine/vllm/defaults.apply_rules), as the space applies them to every trial."""
    from autotune.engine.vllm.defaults import apply_rules

    return apply_rules({"max_model_len": sc.max_model_len, "tensor_parallel_size": sc.tp, **values},
                       sc.max_model_len)


def key_of(sc: Scenario, args: dict[str, Any]) -> str:
    """A measured config's row in the truth: the grid point of its searched knobs, vLLM's rules applied."""
    searched = ("gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
                "enable_prefix_caching")
    gpu = gpu_profile(sc.gpu)
    seqs, tokens = default_batching("cuda", gpu.memory_bytes / (1 << 30), gpu.name)
    full = {"gpu_memory_utilization": 0.9, "max_num_seqs": seqs, "max_num_batched_tokens": tokens,
            "enable_chunked_prefill": True, "enable_prefix_caching": True,
            **{k: args[k] for k in searched if k in args}}
    return json.dumps(_rules(sc, snap(full)), sort_keys=True)


def grid_keys(sc: Scenario) -> list[str]:
    keys = {key_of(sc, {"gpu_memory_utilization": u, "max_num_seqs": s, "max_num_batched_tokens": t,
                        "enable_chunked_prefill": c, "enable_prefix_caching": p})
            for u, s, t, c, p in itertools.product(UTILIZATIONS, SEQS, TOKENS, (False, True), (False, True))}
    return sorted(keys)


def defaults_key(sc: Scenario) -> str:
    return key_of(sc, {})


def baseline_keys(sc: Scenario) -> set[str]:
    """The truth's rows of vLLM's built-in baselines, as a study measures them."""
    from autotune.engine.vllm.defaults import BASELINES

    return {key_of(sc, values) for values in BASELINES.values()}


# --- the truth ----------------------------------------------------------------------------------------------------

def _rng(*parts: Any) -> np.random.Generator:
    return np.random.default_rng([zlib.crc32(str(p).encode()) for p in parts])


def truth_constants(sc: Scenario, seed: int) -> tuple[GpuProfile, FrontEnd]:
    """The truth's constants for this seed: the shipped ones, each times exp(N(0, SIGMA)) clipped at 2 sigma."""
    rng = _rng("truth", sc.name, seed)
    base = gpu_profile(sc.gpu)

    def draw(v: float | None) -> float | None:
        return None if v is None else v * math.exp(float(np.clip(rng.normal(0, SIGMA), -2 * SIGMA, 2 * SIGMA)))

    gpu = replace(base, **{k: draw(getattr(base, k)) for k in GPU_DRAWN})
    gpu = replace(gpu, **{k: min(getattr(gpu, k), 0.95) for k in _SHARES if getattr(gpu, k) is not None})
    front = replace(API_SERVER, **{k: draw(getattr(API_SERVER, k)) for k in FRONT_DRAWN})
    return gpu, front


KNOBS = {"max_num_seqs": SEQS, "max_num_batched_tokens": TOKENS, "enable_chunked_prefill": (False, True),
         "enable_prefix_caching": (False, True)}


@dataclass(frozen=True)
class Form:
    """Where one truth's form differs from the guide's (vllm-sim with the shipped constants), drawn per scenario
    and seed by ``draw_form``. Every field is a term the guide does not have."""

    knobs: dict[str, dict[str, float]]  # per knob, per value: log step time (a trend with its own sign, and jitter)
    activation: float  # the profile run's activation peak (batched tokens and warm-up sequences), times this
    fragmentation: float  # share of the GPU's memory the KV cache loses
    startup: float  # start-up seconds, times this
    long_context: float  # step time x (1 + this x the step's mean context / LONG_CONTEXT)
    preempt_s: float  # seconds per preempted request, beyond its recompute
    request_s: float  # the API server's cost per request
    flipped: str = ""  # adversarial: the knob whose effect the guide gets backwards

    def log_step(self, values: dict[str, Any]) -> float:
        """The config's knobs' term in log step time; a value off the grid takes its nearest grid value's."""
        out = 0.0
        for knob, grid in KNOBS.items():
            if knob in values:
                v = values[knob]
                near = v if isinstance(v, bool) else min(grid, key=lambda g: abs(math.log(g) - math.log(v)))
                out += self.knobs[knob][str(near)]
        return out


def draw_form(sc: Scenario, seed: int, guide: dict[str, float] | None = None) -> Form:
    """The truth's form for a scenario and seed. With the guide's predicted capacity per grid key (``guide``), an
    adversarial seed (``ADVERSARIAL`` and up) also reverses the guide's marginal effect of the knob it says matters
    most."""
    rng = _rng("form", sc.name, seed)
    knobs: dict[str, dict[str, float]] = {}
    for knob, grid in KNOBS.items():
        slope = KNOB_SLOPE * float(np.clip(rng.standard_t(3), -6, 6))
        # the grid is log-spaced: a trend in log value
        knobs[knob] = {str(v): slope * float(z) + float(rng.normal(0, KNOB_JITTER))
                       for v, z in zip(grid, np.linspace(-1, 1, len(grid)), strict=True)}
    hopper = any(g in gpu_profile(sc.gpu).name for g in ("H100", "H200"))
    long_context = (LONG_CONTEXT_HOPPER if hopper else LONG_CONTEXT_OTHER) * math.exp(rng.normal(0, 0.4))
    form = Form(
        knobs=knobs,
        activation=math.exp(float(np.clip(rng.normal(0, ACTIVATION_SIGMA), -2 * ACTIVATION_SIGMA,
                                          2 * ACTIVATION_SIGMA))),
        fragmentation=float(rng.uniform(0, FRAGMENTATION)),
        startup=math.exp(rng.normal(0, math.log(1.5))),
        long_context=long_context,
        preempt_s=PREEMPT_S * math.exp(rng.normal(0, math.log(2))),
        request_s=math.exp(rng.uniform(*map(math.log, REQUEST_S))),
    )
    if seed < ADVERSARIAL or guide is None:
        return form
    knob, effect = guide_effects(guide)
    if not knob:  # the guide ties every config: there is no direction to get backwards
        return form
    knobs[knob] = {v: knobs[knob][v] + FLIP * e for v, e in effect.items()}
    return replace(form, knobs=knobs, flipped=knob)


def guide_effects(guide: dict[str, float]) -> tuple[str, dict[str, float]]:
    """The knob whose values the guide's predictions separate most, and each value's marginal effect on log capacity
    (the mean over the configs with that value, less the mean over the values; configs predicted to hold nothing
    left out); ("", {}) where no knob moves the prediction."""
    best: tuple[float, str, dict[str, float]] = (0.0, "", {})
    for knob in KNOBS:
        by: dict[str, list[float]] = {}
        for key, c in guide.items():
            v = json.loads(key).get(knob)
            if c > 0 and str(v) in {str(g) for g in KNOBS[knob]}:
                by.setdefault(str(v), []).append(math.log(c))
        if len(by) < 2:
            continue
        means = {v: statistics.fmean(xs) for v, xs in by.items()}
        centre = statistics.fmean(means.values())
        effect = {v: m - centre for v, m in means.items()}
        spread = max(effect.values()) - min(effect.values())
        if spread > best[0]:
            best = (spread, knob, effect)
    return best[1], best[2]


@dataclass
class TruthStep(StepModel):
    """The truth's step time: the guide's, times the config's knob term and this run's speed, longer at long
    contexts, plus a cost per preempted request."""

    factor: float = 1.0
    long_context: float = 0.0
    preempt_s: float = 0.0

    def step_seconds(self, plan: StepPlan) -> float:
        s = super().step_seconds(plan)
        tokens = plan.num_tokens
        if tokens:
            context = sum(n * (r.num_computed + n / 2) for r, n in plan.scheduled) / tokens
            s *= 1 + self.long_context * context / LONG_CONTEXT
        return s * self.factor + self.preempt_s * len(plan.preempted)


@dataclass(frozen=True)
class Truth:
    """One truth: a scenario's GPU as this seed has it (constants, form). ``start`` and ``step`` are what a GPU
    would answer; ``speed`` is one measurement's noise (1: the expected behaviour)."""

    sc: Scenario
    seed: int
    gpu: GpuProfile
    front: FrontEnd
    form: Form

    def start(self, key: str) -> tuple[SimConfig, Startup]:
        shape, values = model_shape(self.sc.model), json.loads(key)
        config = SimConfig.from_args(values, self.gpu, shape)
        a = self.form.activation
        # the memory the truth plans with: less of the GPU, and another activation peak (as if batching differed)
        memory = replace(config, gpu_memory_utilization=config.gpu_memory_utilization - self.form.fragmentation,
                         max_num_batched_tokens=max(1, round(config.max_num_batched_tokens * a)),
                         max_num_seqs=max(1, round(config.max_num_seqs * a)))
        s = plan_startup(shape, self.gpu, memory)
        s.phases[:] = [replace(p, seconds=p.seconds * self.form.startup) for p in s.phases]
        return config, s

    def step(self, key: str, started: tuple[SimConfig, Startup], load: float, steps: LoadSteps, slos,
             speed: float = 1.0) -> Summary:
        config, start = started
        assert start.plan is not None
        front = replace(self.front, request_s=self.form.request_s / speed,
                        **{k: getattr(self.front, k) / speed for k in FRONT_DRAWN})
        engine = SimEngine(model_shape(self.sc.model), self.gpu, config, start.plan, front)
        engine.step_model = TruthStep(engine.shape, self.gpu, config,
                                      factor=math.exp(self.form.log_step(json.loads(key))) / speed,
                                      long_context=self.form.long_context, preempt_s=self.form.preempt_s)
        return summarize(simulate(engine, steps.repeated(load, MAX_REQUESTS), warmup=4), slos)

    def expected(self, key: str) -> dict[str, Any]:
        return expected_capacity((self, key))

    @property
    def noise_key(self) -> tuple[str, int]:
        return self.sc.name, self.seed


@dataclass(frozen=True)
class FileTruth:
    """A truth read from a truth file (scripts/truth_file.py): a measurement is the file's nearest config's
    expected metrics at the offered rate, at the measurement's own speed."""

    sc: Scenario
    file: truth_file.TruthFile
    seed: int = 0

    @classmethod
    def read(cls, path: Path) -> FileTruth:
        from autotune.measure.slo import SLOSyntaxError, parse_slos

        def judged(slos: list[str]) -> Callable[[dict[str, float]], bool]:
            try:
                parsed = parse_slos(list(slos))
            except SLOSyntaxError as e:
                raise truth_file.TruthFileError(f"{path}: the scenario's SLOs: {e}") from e
            return lambda m: _holds(lookup_summary(m, 1.0, 2, 0.0, parsed), parsed)

        f = truth_file.read(path, judged)
        fields = {k: v for k, v in f.scenario.items()}
        try:
            sc = Scenario(**{**fields, "slos": tuple(fields.get("slos", ())),
                             "overrides": tuple((k, tuple(r)) for k, r in fields.get("overrides", ()))})
            gpu_profile(sc.gpu), model_shape(sc.model), WORKLOADS[sc.workload]
        except (TypeError, KeyError) as e:
            raise truth_file.TruthFileError(
                f"{path}: its scenario must name Scenario's fields ({', '.join(Scenario.__dataclass_fields__)}) "
                f"with a model, GPU and workload vllm-sim knows: {e}") from e
        return cls(sc, f)

    @property
    def noise_key(self) -> tuple[str, str]:
        return "file", self.file.name

    def start(self, key: str) -> truth_file.Row:
        return self.file.nearest(json.loads(key))

    def step(self, key: str, row: truth_file.Row, load: float, steps: LoadSteps, slos, speed: float = 1.0) -> Summary:
        rps = steps.base.rate * load
        metrics = row.metrics_at(rps / speed)
        metrics = {k: v / speed if k in truth_file.LATENCIES else v * speed for k, v in metrics.items()}
        return lookup_summary(metrics, rps, MAX_REQUESTS, _output_tokens(self.sc), slos)

    def expected(self, key: str) -> dict[str, Any]:
        from autotune.measure.slo import parse_slos

        row = self.start(key)
        if not row.starts:
            return {"starts": False, "start_s": row.start_s, "failure": row.failure[:200]}
        slos = parse_slos(list(self.sc.slos))
        return {"starts": True, "start_s": row.start_s,
                "capacity": row.capacity(lambda m: _holds(lookup_summary(m, 1.0, 2, 0.0, slos), slos))}


def _holds(s: Summary, slos) -> bool:
    return s.failed == 0 and all(v.holds for v in s.verdicts(slos))


@functools.cache
def _output_tokens(sc: Scenario) -> float:
    """The base workload's mean output tokens per request."""
    w = base_workload(sc)
    return statistics.fmean(r.output_tokens for r in w.requests)


def lookup_summary(metrics: dict[str, float], rps: float, requests: int, output_tokens: float, slos) -> Summary:
    """A load step's summary from expected metrics (a truth file's): ``requests`` completed at ``rps``, each latency
    read at every percentile as the one value given."""
    from autotune.measure.metrics import Distribution

    latencies = {k: [metrics[k]] for k in truth_file.LATENCIES if k in metrics}
    duration = requests / rps
    output = metrics.get("output_throughput", rps * output_tokens)
    summary = Summary(requests=requests, completed=requests, failed=0, duration_s=duration, prompt_tokens=0,
                      output_tokens=round(output * duration), request_throughput=rps, output_throughput=output,
                      total_token_throughput=output, goodput=0.0, slo_attainment=0.0,
                      ttft=Distribution.of(latencies.get("ttft", [])), tpot=Distribution.of(latencies.get("tpot", [])),
                      itl=Distribution.of(latencies.get("itl", [])), e2e=Distribution.of(latencies.get("e2e", [])),
                      send_lag=Distribution.of([0.0]), errors={}, samples=latencies)
    good = all(v.holds for v in summary.verdicts(slos))
    return replace(summary, goodput=rps if good else 0.0, slo_attainment=1.0 if good else 0.0)


_GUIDES: dict[str, dict[str, float]] = {}  # per scenario: the shipped predictions, for adversarial truths


def truth_of(sc: Scenario, seed: int) -> Truth:
    assert seed < ADVERSARIAL or sc.name in _GUIDES, "an adversarial truth needs the guide's predictions"
    gpu, front = truth_constants(sc, seed)
    return Truth(sc, seed, gpu, front, draw_form(sc, seed, _GUIDES.get(sc.name)))


def measurement_speed(*parts: Any) -> float:
    """One measurement's speed (1: the truth's expected): a few percent, and now and then a stall. Keyed by
    (scenario, truth, config, k-th measurement of that config in the run): common random numbers, so every strategy
    meets the same luck on the same config."""
    rng = _rng("measure", *parts)
    speed = math.exp(rng.normal(0, MEASURE_SD))
    return speed * float(rng.uniform(*STALL)) if rng.random() < STALL_P else speed


def base_workload(sc: Scenario):
    spec = WORKLOADS[sc.workload].with_overrides(**dict(sc.overrides))
    return synthesize(spec, rate=sc.rate, num_requests=sc.requests, seed=0)


def _steps(sc: Scenario) -> LoadSteps:
    return LoadSteps.of(base_workload(sc), STEP_S)


def expected_capacity(job: tuple[Truth, str]) -> dict[str, Any]:
    """A config's row of the truth: its start-up, and the highest load (req/s) at which its expected behaviour (no
    measurement noise) meets every SLO."""
    from autotune.measure.slo import parse_slos

    truth, key = job
    started = truth.start(key)
    start = started[1]
    if start.plan is None:
        return {"starts": False, "start_s": start.seconds, "failure": start.failure[0][:200]}
    sc = truth.sc
    slos, steps = parse_slos(list(sc.slos)), _steps(sc)

    def holds(k: int) -> bool:
        s = truth.step(key, started, 2 ** (k / GRID), steps, slos)
        return s.failed == 0 and all(v.holds for v in s.verdicts(slos))

    k = highest_holding(holds, -4 * GRID, 4 * GRID, stride=GRID)
    # req/s of the replayed workload, as a measurement states it (the synthesized base's own rate, not sc.rate)
    return {"starts": True, "start_s": start.seconds,
            "capacity": 0.0 if k is None else steps.base.rate * 2 ** (k / GRID)}


def truth_table(truth: Truth, jobs: int, fresh: bool = False) -> dict[str, dict[str, Any]]:
    """Every grid config's expected capacity in this truth (cached: bench/search-truth/SCENARIO-SEED.json)."""
    sc = truth.sc
    path = ROOT / "bench" / "search-truth" / f"{sc.name}-{truth.seed}.json"
    keys = grid_keys(sc)
    stamp = {"version": TRUTH_VERSION, "grid": GRID, "max_requests": MAX_REQUESTS, "scenario": asdict(sc),
             "truth": [asdict(truth.gpu), asdict(truth.front), asdict(truth.form)]}

    def compute() -> dict[str, dict[str, Any]]:
        t0 = time.monotonic()
        with multiprocessing.Pool(jobs) as pool:
            rows = dict(zip(keys, pool.map(expected_capacity, [(truth, k) for k in keys], chunksize=2), strict=True))
        print(f"  truth {sc.name} seed {truth.seed}: {len(rows)} configs in {time.monotonic() - t0:.0f} s",
              file=sys.stderr)
        return rows

    return _cached_rows(path, stamp, keys, compute, fresh)


def _cached_rows(path: Path, stamp: dict[str, Any], keys: list[str], compute: Callable[[], dict[str, Any]],
                 fresh: bool = False) -> dict[str, Any]:
    """A table of rows per grid key, from ``path`` where its stamp (what the rows were computed from) matches and
    it holds every key, else computed and written there."""
    stamp = json.loads(json.dumps(stamp))  # as it reads back (tuples become lists)
    if path.exists() and not fresh:
        cached = json.loads(path.read_text())
        if cached.get("stamp") == stamp and set(cached["rows"]) >= set(keys):
            return cached["rows"]
    rows = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"stamp": stamp, "rows": rows}, indent=0, sort_keys=True))
    return rows


@dataclass(frozen=True)
class Circularity:
    """How far a truth is from the guide, in the terms bench/sim_fidelity.md measures real GPUs by."""

    spearman: float  # guide's predicted capacity vs the truth's expected, over the grid
    starts_not: int  # configs the guide expects to start that fail in the truth
    fails_not: int  # configs the guide expects to fail that start in the truth
    first_pick: float  # the guide's best predicted config's expected capacity, as a share of the optimum (ties: mean)


def circularity(sc: Scenario, table: dict[str, dict[str, Any]], guide: dict[str, float],
                rank: dict[str, float] | None = None) -> Circularity:
    """The check for one truth; the first pick is the guide's best by ``rank`` (what a study orders by: the
    capacity, finer than its load grid) where given, else by its capacity."""
    from autotune.sim.fit import spearman

    keys = sorted(guide)
    shape, gpu = model_shape(sc.model), gpu_profile(sc.gpu)
    guide_starts = {k: plan_startup(shape, gpu, SimConfig.from_args(json.loads(k), gpu, shape)).plan is not None
                    for k in keys}
    optimum = max(r.get("capacity", 0.0) for r in table.values()) or 1.0
    order = rank or guide
    top = max(order.values())
    tie = [k for k in keys if order[k] >= top * (1 - 1e-9)]
    return Circularity(
        spearman=spearman([guide[k] for k in keys], [table[k].get("capacity", 0.0) for k in keys]),
        starts_not=sum(guide_starts[k] and not table[k]["starts"] for k in keys),
        fails_not=sum(not guide_starts[k] and table[k]["starts"] for k in keys),
        first_pick=statistics.fmean(table[k].get("capacity", 0.0) for k in tie) / optimum,
    )


# --- measuring on the truth -------------------------------------------------------------------------------------

@dataclass
class Trial:
    key: str
    measured: float  # the capacity this run measured (0: it did not start)
    expected: float  # the truth's expected capacity of the config
    gpu_s: float  # what the trial cost, in GPU-seconds
    confirms: bool = False  # a re-measurement after the search: GPU time spent confirming the winner


@dataclass
class TruthGpu:
    """The GPU host the strategies measure on: the truth engine, started per trial, its load steps replayed in
    virtual time, each measurement at its own drawn speed. ``measure`` returns what autotune's measurer would
    (``OnTruth`` is the study's Measurer on it). ``declared`` records, after each trial, the config the strategy
    would hand a user."""

    truth: Truth | FileTruth
    table: dict[str, dict[str, Any]]
    trials: list[Trial] = field(default_factory=list)
    declared: list[tuple[float, str | None]] = field(default_factory=list)  # (GPU-seconds so far, config)
    held_idle_s: float = 0.0  # the study's own CPU time since the last trial (the simulator): the GPU waits
    confirming: bool = False  # the search is over: what is measured now confirms its winner

    def __post_init__(self) -> None:
        from autotune.measure.slo import parse_slos

        self.sc = self.truth.sc
        self.slos = parse_slos(list(self.sc.slos))
        self.steps = _steps(self.sc)

    def row(self, key: str) -> dict[str, Any]:
        if key not in self.table:  # a baseline off the grid (xinference-legacy's 0.7)
            self.table[key] = self.truth.expected(key)
        return self.table[key]

    def start(self, key: str) -> dict[str, Any]:
        """Start (and, where it fails, lose) an engine without measuring it: auto_tune's utilization probe."""
        r = self.row(key)
        self._spent(key, 0.0, r["start_s"] + STOP_S)
        return r

    def declare(self, key: str | None) -> None:
        self.declared.append((sum(t.gpu_s for t in self.trials), key))

    def _spent(self, key: str, measured: float, engine_s: float) -> None:
        self.trials.append(Trial(key, measured, self.row(key).get("capacity", 0.0),
                                 (self.held_idle_s + engine_s) * self.sc.gpus, self.confirming))
        self.held_idle_s = 0.0

    def measure(self, args: EngineArgs, slos, profile: LoadProfile,
                on_step: Callable[[Outcome], bool] | None = None) -> Outcome:
        key = key_of(self.sc, args.values)
        r = self.row(key)
        out = Outcome(url="truth")
        if not r["starts"]:
            watch = LogWatch(patterns=list(PATTERNS))  # vLLM's failure texts, as the launcher reads them
            watch.feed(r["failure"])
            out.failure, out.engine_failed_after_s = classify_exit(1, watch), r["start_s"]
            self._spent(key, 0.0, r["start_s"] + STOP_S)
            return out
        out.engine_ready_s = r["start_s"]
        started = self.truth.start(key)
        speed = measurement_speed(*self.truth.noise_key, key, sum(t.key == key for t in self.trials))
        while (load := profile.next_load([(s.load, s.passed) for s in out.steps])) is not None:
            summary = self.truth.step(key, started, load, self.steps, slos, speed)
            out.steps.append(Step(load, self.steps.base.rate * load, summary, summary.verdicts(slos), STEP_S))
            if on_step is not None and on_step(out):
                out.stopped_early = True
                break
        self._spent(key, out.capacity_rps, r["start_s"] + len(out.steps) * STEP_S + STOP_S)
        return out


@dataclass
class OnTruth:
    """A study's Measurer (autotune/study/measurer.py) on the truth GPU: configs checked as the real one checks
    them, measured by ``gpu``."""

    gpu: TruthGpu
    command: EngineCommand  # the study's
    table: FlagTable
    slos: list[SLO]

    def check(self, args: EngineArgs) -> CheckedArgs:
        return self.command.check(args, self.table)

    def measure(self, config: CheckedArgs, profile: LoadProfile, *,
                on_step: Callable[[Outcome], bool] | None = None, **_: Any) -> Outcome:
        return self.gpu.measure(config.args, self.slos, profile, on_step)


# --- the strategies -----------------------------------------------------------------------------------------------

_SHIPPED: dict[str, dict[str, Any]] = {}  # per scenario: the shipped simulator's predictions, the same in every run


class _Charged(Advisor):
    """The study's advisor, remembering its predictions (a study asks again for the same configs after every
    trial, and the benchmark runs the same study many times) and charging every answer the CPU seconds it took to
    compute the first time, and every refit its CPU seconds, as GPU time held idle: saves the benchmark's CPU,
    changes neither an answer nor what it costs the study."""

    def __init__(self, inner: Any, cache: dict[str, Any], charge: Callable[[float], None]) -> None:
        self.inner, self.cache, self.charge = inner, cache, charge
        self.predicts, self.learns, self.describe = inner.predicts, inner.learns, inner.describe
        self.sim = inner.sim

    def predict(self, points):
        out = []
        for p in points:
            k = json.dumps(p, sort_keys=True)
            if k not in self.cache:
                t0 = time.process_time()
                self.cache[k] = (self.inner.predict([p])[0], time.process_time() - t0)
            answer, seconds = self.cache[k]
            self.charge(seconds)
            out.append(answer)
        return out

    def startup_failure(self, values):
        return self.inner.startup_failure(values)

    def learn(self, study):
        t0 = time.process_time()
        said = self.inner.learn(study)
        self.charge(time.process_time() - t0)
        if self.inner.sim is not self.sim:  # a new fit: a new memory
            self.sim, self.cache = self.inner.sim, {}
        return said



def run_study(sc: Scenario, gpu: TruthGpu, strategy: str, seed: int, budget: int, say: Callable[[str], None],
              gpus: int | None = None, drive: Callable[[Any, optuna.Study], None] | None = None) -> None:
    """One of autotune's own strategies: the real StudyRun, measuring on the truth, then its re-measurement of the
    top candidates against the best baseline, as `autotune study` ends; the declared config is the study's
    winner (what best.yaml would hold) after every trial and after the re-measurement. ``gpus``: the study's
    `[engine] gpus` (trials side by side, each on the scenario's TP); ``drive``: what runs the trials in place of
    ``StudyRun.optimize`` (scripts/bench_parallel.py: side by side in virtual time)."""
    from autotune.sim.advisor import learning_simulator
    from autotune.study import runner
    from autotune.study.definition import load_study
    from autotune.study.records import StudyResult
    from autotune.study.storage import open_study

    def winner(study: optuna.Study) -> str | None:
        w = StudyResult.of(study).winner
        return None if w is None else key_of(sc, dict(w.engine_args.values))

    ours = strategy == "autotune"
    with tempfile.TemporaryDirectory(prefix="bench-search-") as tmp:
        root = Path(tmp)
        path = root / "study.toml"
        text = study_text(sc, f"{strategy}-{seed}", root, sampler="random" if strategy == "random" else "tpe",
                          race=ours, baselines=strategy != "random", budget=budget, seed=seed)
        if gpus is not None:
            text = text.replace('platform = "cuda"\n', f'platform = "cuda"\ngpus = "0-{gpus - 1}"\n', 1)
        path.write_text(text)
        os.environ["AUTOTUNE_STATE_DIR"] = str(root / "state")  # this run's calibration only
        d = load_study(path)
        steps = _steps(sc)
        advisor = None
        if ours:  # as `autotune study` sets a study of real vLLM up on a GPU host: it learns from every trial

            def charge(seconds: float) -> None:
                gpu.held_idle_s += seconds

            shipped, _ = learning_simulator(runner.advisor_target(d, steps))
            advisor = _Charged(shipped, _SHIPPED.setdefault(sc.name, {}), charge)
        measurer = OnTruth(gpu, d.command, d.command.flag_table(), d.slos)
        run = runner.StudyRun(d, measurer, steps, show=lambda _: None, notice=say, advisor=advisor)
        run.callbacks = [lambda study, _: gpu.declare(winner(study))]
        optuna.logging.set_verbosity(optuna.logging.ERROR)
        study = open_study(d)
        (drive or runner.StudyRun.optimize)(run, study)
        gpu.confirming = True
        if run.scoring.remeasured and run.remeasure(study) is not None:
            gpu.declare(winner(study))


def run_auto_tune(sc: Scenario, gpu: TruthGpu, budget: int) -> None:
    """benchmarks/auto_tune.sh: the highest utilization that starts (top down, at vLLM's default batching; it
    only starts the server there), then its max_num_seqs x max_num_batched_tokens lists, in order."""
    util = next((u for u in sorted(UTILIZATIONS, reverse=True)
                 if gpu.start(key_of(sc, {"gpu_memory_utilization": u}))["starts"]), None)
    if util is None:
        return
    for s, t in itertools.product(SEQS, TOKENS):
        if len(gpu.trials) >= budget:
            return
        if t >= s:  # vLLM refuses fewer batched tokens than sequences; auto_tune's lists avoid it
            _measure_grid_point(sc, gpu, {"gpu_memory_utilization": util, "max_num_seqs": s,
                                          "max_num_batched_tokens": t})


def run_sweep(sc: Scenario, gpu: TruthGpu, budget: int) -> None:
    """vllm bench sweep with the docs' staircase of (max_num_seqs, max_num_batched_tokens), continued."""
    stairs = [(32, 2048), (64, 2048), (64, 4096), (128, 4096), (128, 8192), (256, 8192), (256, 16384),
              (512, 16384), (1024, 16384)]
    for s, t in stairs[:budget]:
        _measure_grid_point(sc, gpu, {"max_num_seqs": s, "max_num_batched_tokens": t})


def _measure_grid_point(sc: Scenario, gpu: TruthGpu, values: dict[str, Any]) -> None:
    """One grid point measured once; a grid declares the best it has measured (the first on a tie)."""
    from autotune.measure.profiles import Ladder

    key = key_of(sc, values)
    gpu.measure(EngineArgs(json.loads(key)), gpu.slos, Ladder(1.0, MAX_STEPS, 1.25))
    best = max(gpu.trials, key=lambda t: t.measured)  # max keeps the first of equals
    gpu.declare(best.key if best.measured > 0 else None)


STRATEGIES = ("autotune", "TPE", "random", "auto_tune grid", "bench sweep grid")


def one_run(truth: Truth | FileTruth, strategy: str, budget: int, table: dict, say: Callable[[str], None]) -> TruthGpu:
    gpu = TruthGpu(truth, table)
    if strategy in ("autotune", "TPE", "random"):
        run_study(truth.sc, gpu, strategy, truth.seed, budget, say)
    elif strategy == "auto_tune grid":
        run_auto_tune(truth.sc, gpu, budget)
    else:
        run_sweep(truth.sc, gpu, budget)
    return gpu


# --- the score ----------------------------------------------------------------------------------------------------

def curve(gpu: TruthGpu, table: dict[str, dict[str, Any]]) -> list[tuple[float, float]]:
    """(GPU-hours so far, the declared config's expected capacity as a share of the optimum) after each
    declaration, at 1 % resolution; the run's last point at its total GPU-hours."""
    optimum = max(r.get("capacity", 0.0) for r in table.values())
    points = [(s / 3600, round((table[k].get("capacity", 0.0) if k else 0.0) / optimum, 2))
              for s, k in gpu.declared]
    total = sum(t.gpu_s for t in gpu.trials) / 3600
    return [*points, (total, points[-1][1] if points else 0.0)]


def settled(points: list[tuple[float, float]], trials: list[Trial]) -> tuple[int | None, float | None]:
    """(real trials, GPU-hours) until the declared config is within TARGET of the expected optimum and stays there
    to the run's end; (None, None): it is not at the end."""
    at = search_scores.hours_to_target(points)
    if at is None:
        return None, None
    return sum(spent <= at * 3600 + 1e-6 for spent in itertools.accumulate(t.gpu_s for t in trials)), at


def shipped_prediction(job: tuple[Scenario, str]) -> tuple[float, float]:
    """The shipped simulator's (capacity, rank) of a config (req/s both): what autotune states and what it orders
    by before it has measured anything (sim/advisor.simulator with vllm-sim's own constants, as a study builds it
    on a host with no fit yet)."""
    from autotune.measure.slo import parse_slos
    from autotune.sim.advisor import devices_of_profile, simulator
    from autotune.study.advisor import AdvisorTarget

    sc, key = job
    target = AdvisorTarget(sc.model, model_shape(sc.model), "cuda", devices_of_profile(sc.gpu), _steps(sc),
                           parse_slos(list(sc.slos)), "shipped")
    sim, why = simulator(target, calibrated=False)
    assert sim is not None, why
    p = sim.one(json.loads(key))
    return p.capacity_rps or 0.0, p.rank_rps or 0.0


def shipped_table(sc: Scenario, jobs: int) -> tuple[dict[str, float], dict[str, float]]:
    """Every grid config's shipped prediction: (capacity, rank) per key (cached: bench/search-truth/
    SCENARIO-shipped.json, stamped with the shipped constants, so a new calibration computes it again)."""
    from autotune.sim import rank

    path = ROOT / "bench" / "search-truth" / f"{sc.name}-shipped.json"
    keys = grid_keys(sc)
    stamp = {"scenario": asdict(sc), "gpu": asdict(gpu_profile(sc.gpu)), "front": asdict(API_SERVER),
             "grid": rank.GRID, "max_requests": MAX_REQUESTS, "rows": ["capacity_rps", "rank_rps"]}

    def compute() -> dict[str, list[float]]:
        with multiprocessing.Pool(jobs) as pool:
            return dict(zip(keys, map(list, pool.map(shipped_prediction, [(sc, k) for k in keys], chunksize=2)),
                            strict=True))

    rows = _cached_rows(path, stamp, keys, compute)
    return {k: rows[k][0] for k in keys}, {k: rows[k][1] for k in keys}



def utilization_rule(table: dict[str, dict[str, Any]]) -> tuple[float, tuple[int, int, int]]:
    """The evidence for the runner's rule "gpu_memory_utilization: the highest that starts" (issue 10, item 4),
    in one truth: (the best capacity left when every config runs at its highest utilization that starts, as a
    share of the optimum; (adjacent utilization pairs that both start, pairs where the higher holds at least as
    much, pairs where it holds more than 10 % less))."""
    groups: dict[str, dict[float, dict[str, Any]]] = {}
    for key, row in table.items():
        values = json.loads(key)
        groups.setdefault(json.dumps({k: v for k, v in values.items() if k != "gpu_memory_utilization"},
                                     sort_keys=True), {})[values["gpu_memory_utilization"]] = row
    optimum = max(r.get("capacity", 0.0) for r in table.values())
    kept, both, better, worse = 0.0, 0, 0, 0
    for by_util in groups.values():
        started = sorted(u for u, r in by_util.items() if r["starts"])
        if started:
            kept = max(kept, by_util[started[-1]]["capacity"])
        for lo, hi in itertools.pairwise(started):
            both += 1
            better += by_util[hi]["capacity"] >= by_util[lo]["capacity"]
            worse += by_util[hi]["capacity"] < by_util[lo]["capacity"] / 1.1
    return (kept / optimum if optimum else 1.0), (both, better, worse)



def _median(xs: list[float | None], fmt: str, budget: int) -> str:
    m = statistics.median([math.inf if x is None else x for x in xs])
    return f"> {budget} trials" if math.isinf(m) else fmt.format(m)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3, help="truths (and search seeds) per scenario")
    ap.add_argument("--adversarial", action="store_true",
                    help=f"adversarial truths (seeds {ADVERSARIAL} and up): the guide gets one knob backwards")
    ap.add_argument("--budget", type=int, default=15, help="real trials per search run")
    ap.add_argument("--jobs", type=int, default=max(1, multiprocessing.cpu_count()))
    ap.add_argument("--fresh", action="store_true", help="compute the truth even when cached")
    ap.add_argument("--scenario", action="append", help="only these scenarios")
    ap.add_argument("--strategy", action="append", choices=STRATEGIES, help="only these strategies")
    ap.add_argument("--truth-file", type=Path, metavar="JSONL",
                    help="run against this truth instead of the simulator's (format: scripts/truth_file.py)")
    ap.add_argument("--survey", action="store_true", help="only the truths: defaults, optimum and circularity check")
    ap.add_argument("--json", type=Path, help="also write every run's trials and curve here")
    ap.add_argument("--plot", type=Path,
                    help="render the declared best's curves here (needs matplotlib: pip install -e '.[bench]')")
    ap.add_argument("-v", "--verbose", action="store_true", help="print what autotune's runs say")
    ap.add_argument("--table-from", type=Path, nargs="+", metavar="JSON",
                    help="run nothing: the tables of these --json files' runs (a later file's run of the same "
                    "scenario, seed and strategy replaces an earlier one's), and with --json their merge")
    a = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    if a.table_from:
        return table_from(a.table_from, a.json, a.budget, a.plot)
    say = (lambda m: print(f"    {m}", file=sys.stderr)) if a.verbose else (lambda _: None)
    dump: list[dict[str, Any]] = []
    if a.truth_file:
        try:
            truth = FileTruth.read(a.truth_file)
        except truth_file.TruthFileError as e:
            print(f"bench_search: {e}", file=sys.stderr)
            return 2
        sc = truth.sc
        _introduce(sc)
        guide, ranks = shipped_table(sc, a.jobs)
        table = {k: truth.expected(k) for k in grid_keys(sc)}
        dump += run_truth(a, truth, table, guide, ranks, say, dump)
    first = ADVERSARIAL if a.adversarial else 0
    for sc in SCENARIOS if not a.truth_file else ():
        if a.scenario and sc.name not in a.scenario:
            continue
        _introduce(sc)
        guide, ranks = shipped_table(sc, a.jobs)
        _GUIDES[sc.name] = guide
        for seed in range(first, first + a.seeds):
            sim_truth = truth_of(sc, seed)
            dump += run_truth(a, sim_truth, truth_table(sim_truth, a.jobs, a.fresh), guide, ranks, say, dump)
    print_tables(dump, a.budget)
    if a.plot and not a.survey:
        plot_curves(dump, a.plot)
    return 0


def _introduce(sc: Scenario) -> None:
    print(f"\n{sc.name}: {sc.model} on {sc.tp}x {sc.gpu}, {sc.workload} at {sc.rate} req/s, SLOs "
          f"{', '.join(sc.slos)}", file=sys.stderr)


def run_truth(a: argparse.Namespace, truth: Truth | FileTruth, table: dict[str, dict[str, Any]],
              guide: dict[str, float], ranks: dict[str, float], say: Callable[[str], None],
              before: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every strategy's run on one truth (or, with --survey, the truth alone), as dump entries; with --json the
    file is rewritten after every run, ``before`` included."""
    sc, seed = truth.sc, truth.seed
    optimum = max(r.get("capacity", 0.0) for r in table.values())
    share = table[defaults_key(sc)].get("capacity", 0.0) / optimum if optimum else 0.0
    check = circularity(sc, table, guide, ranks)
    flipped = truth.form.flipped if isinstance(truth, Truth) else ""
    said = f", the guide's {flipped} reversed" if flipped else ""
    name = f"seed {seed}" if isinstance(truth, Truth) else f"truth file {truth.file.name!r}"
    print(f"  {name}{said}: optimum {optimum:.2f} req/s, vLLM defaults at {share:.0%}; guide vs "
          f"truth: Spearman {_rho(check.spearman)}, {check.starts_not} configs start in the guide only and "
          f"{check.fails_not} in the truth only, its first pick at {check.first_pick:.0%}", file=sys.stderr)
    base = {"scenario": sc.name, "gpus": sc.gpus, "seed": seed, "optimum": optimum, "defaults_share": share,
            "flipped": flipped, "circularity": asdict(check)}
    if a.survey:
        kept, (both, better, worse) = utilization_rule(table)
        print(f"    at the highest utilization that starts: {kept:.1%} of the optimum left; of {both} "
              f"utilization steps up, {better} hold at least as much, {worse} more than 10 % less", file=sys.stderr)
        return [{**base, "strategy": "", "utilization_rule": [kept, both, better, worse]}]
    out = []
    for strategy in a.strategy or STRATEGIES:
        t0 = time.monotonic()
        gpu = one_run(truth, strategy, a.budget, table, say)
        points = curve(gpu, table)
        trials, hours = settled(points, gpu.trials)
        print(f"    {strategy}: declares {points[-1][1]:.0%} of the optimum after {len(gpu.trials)} trials "
              f"({points[-1][0]:.2f} GPU-h); within 95 % for good after {trials or '-'} trials, "
              f"{hours or 0:.2f} GPU-h ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
        out.append({**base, "strategy": strategy, "trials_to_95": trials, "gpu_hours_to_95": hours,
                    "declared_share": points[-1][1], "curve": points,
                    "declared": [k for _, k in gpu.declared], "trials": [asdict(t) for t in gpu.trials]})
        if a.json:  # after every run: a long benchmark stopped halfway keeps what it measured
            a.json.write_text(json.dumps(before + out, indent=1))
    return out


def _rho(r: float) -> str:
    return "n/a (the guide ties every config)" if math.isnan(r) else f"{r:+.2f}"


def circularity_rows(dump: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """Per scenario: the circularity check over its truths (one row per truth in the dump)."""
    rows = []
    for name in dict.fromkeys(d["scenario"] for d in dump):
        truths = {d["seed"]: d for d in dump if d["scenario"] == name}.values()
        checks = [Circularity(**d["circularity"]) for d in truths]
        rows.append((name, f"{statistics.median(d['defaults_share'] for d in truths):.0%}",
                     _rho(statistics.median(c.spearman for c in checks)),
                     f"{sum(c.starts_not for c in checks)} / {sum(c.fails_not for c in checks)}",
                     f"{sum(c.first_pick >= TARGET for c in checks)}/{len(checks)}"))
    return rows


def summary_rows(dump: list[dict[str, Any]], budget: int) -> list[tuple[str, ...]]:
    """The search table's rows of a dump of runs (--json): per scenario and strategy, in the order they appear."""
    rows = []
    runs_of = [d for d in dump if d["strategy"]]
    for name in dict.fromkeys(d["scenario"] for d in runs_of):
        runs = [d for d in runs_of if d["scenario"] == name]
        for strategy in sorted({d["strategy"] for d in runs}, key=STRATEGIES.index):
            mine = [d for d in runs if d["strategy"] == strategy]
            rows.append((name, strategy,
                         _median([d["gpu_hours_to_95"] for d in mine], "{:.2f}", budget),
                         _median([d["trials_to_95"] for d in mine], "{:.0f}", budget),
                         f"{sum(d['trials_to_95'] is not None for d in mine)}/{len(mine)}",
                         f"{statistics.median(d['declared_share'] for d in mine):.0%}"))
    return rows


def table_from(paths: list[Path], out: Path | None, budget: int, plot: Path | None = None) -> int:
    merged: dict[tuple[str, int, str], dict[str, Any]] = {}
    for path in paths:
        for run in json.loads(path.read_text()):
            merged[(run["scenario"], run["seed"], run["strategy"])] = run
    dump = list(merged.values())
    if out is not None:
        out.write_text(json.dumps(dump, indent=1))
    print_tables(dump, budget)
    if plot is not None:
        plot_curves(dump, plot)
    return 0


def print_tables(dump: list[dict[str, Any]], budget: int) -> None:
    if not dump:
        return
    print("\n| scenario | vLLM defaults / optimum (median) | Spearman guide vs truth (median) "
          "| start-ups: guide only / truth only | guide's first pick within 95 % |")
    print("|---|---|---|---|---|")
    for r in circularity_rows(dump):
        print("| " + " | ".join(r) + " |")
    rows = summary_rows(dump, budget)
    if rows:
        print("\n| scenario | strategy | median GPU-hours to a declared best within 95 % | median real trials "
              "| runs that got there | declared at the end (median) |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print("| " + " | ".join(r) + " |")
    gpus = {sc.name: sc.gpus for sc in SCENARIOS}
    scores = [search_scores.RunScore.of(d, d.get("gpus", gpus.get(d["scenario"], 1))) for d in dump if d["strategy"]]
    if scores:
        search_scores.print_scores(scores, STRATEGIES)
    by_name = {sc.name: sc for sc in SCENARIOS}
    confirm = search_scores.confirmation_rows(
        [d for d in dump if d["scenario"] in by_name], budget, lambda name: baseline_keys(by_name[name]))
    if confirm:
        search_scores.print_rows(["strategy", "GPU-hours spent confirming the winner (runs that confirm)",
                                  "runs handed a baseline while a config 1/0.95x better was measured"], confirm)


def plot_curves(dump: list[dict[str, Any]], path: Path) -> None:
    """Per scenario, the median over its runs of the declared config's expected capacity (share of the optimum)
    against GPU-hours, one line per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [d for d in dump if d["strategy"]]
    names = list(dict.fromkeys(d["scenario"] for d in runs))
    cols = 3
    fig, axes = plt.subplots(-(-len(names) // cols), cols, figsize=(15, 4 * -(-len(names) // cols)), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        mine = [d for d in runs if d["scenario"] == name]
        end = max(d["curve"][-1][0] for d in mine)
        xs = np.linspace(0, end, 200)
        for strategy in sorted({d["strategy"] for d in mine}, key=STRATEGIES.index):
            curves = [d["curve"] for d in mine if d["strategy"] == strategy]

            def at(c: list[list[float]], x: float) -> float:
                return next((s for h, s in reversed(c) if h <= x), 0.0)

            ax.step(xs, [statistics.median(at(c, x) for c in curves) for x in xs], where="post", label=strategy)
        ax.axhline(TARGET, color="grey", lw=0.5, ls="--")
        ax.set(title=name, xlabel="GPU-hours", ylabel="declared / expected optimum", ylim=(0, 1.05))
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


if __name__ == "__main__":
    sys.exit(main())
