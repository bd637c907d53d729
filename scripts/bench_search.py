"""GPU-hours to a near-optimal vLLM config: autotune's search against its peers, on a truth it cannot see.

The truth is not the guide. For each scenario (model, GPU, workload, SLOs) and seed:

1. **The truth**: vllm-sim with *other* constants than the ones autotune ships. Every time constant the
   fidelity table (bench/sim_fidelity.md) leaves uncertain is drawn per seed, log-normally, within that
   table's held-out error: GEMM and attention shares of the datasheet peaks, the host's cost per step and per
   sequence, the all-reduce, the API server's costs (``SIGMA``; clipped at 2 sigma). On top, every config gets
   its own few-percent speed noise (``NOISE``), drawn from (seed, config). A config's true capacity is the
   highest load (4.4 % apart) at which the truth meets every SLO; the optimum is the best over the grid
   below (``truth_table``, cached under bench/search-truth/).
2. **The strategies** measure configs only through the truth, as a GPU would answer: each real trial starts
   the truth engine (its simulated start-up time, failed starts included) and replays the study's load steps
   on it (``TruthGpu.measure``, standing in for autotune's one measurement function). They are:
   - **autotune**: the real ``StudyRun`` (study/runner.py) as ``autotune study`` sets it up on a GPU host:
     baselines, simulate first with the *shipped* calibration, refit on every measured trial, race the
     incumbent, TPE once the simulator stops (sim/advisor.py's learning_simulator);
   - **TPE**: the same runner with no simulator and no race (autotune before issue 10);
   - **random**: Optuna's random sampler, no baselines;
   - **auto_tune grid**: vLLM's benchmarks/auto_tune.sh: the highest gpu_memory_utilization that starts
     (found top down by failed starts), then max_num_seqs x max_num_batched_tokens in list order;
   - **bench sweep grid**: ``vllm bench sweep serve --serve-params`` with the staircase list of vLLM's docs
     (https://docs.vllm.ai/en/latest/benchmarking/sweeps/), continued over this space, at vLLM's defaults.
3. **The floor** (``--survey``): a search that knew each seed's drawn constants, but not each config's own
   noise, would still have to measure configs until it met one within 95 % (``oracle_picks``). Where many
   configs tie within the noise, that is several, whatever the search; it bounds what better ranking can win.
4. **The score**: per run, the real trials and GPU-hours (start-ups, failed ones included, plus load steps,
   times the tensor-parallel GPUs) until a trial measures a config whose true capacity is within 95 % of the
   optimum; the median over seeds ("> N" when fewer than half the runs got there within the budget). The
   CPU seconds autotune's simulator spends between trials (its predictions, its refits, on this machine) are
   GPU time too: the study holds its GPU meanwhile.

A config the search samples between grid points is measured as its nearest grid point (log scale for
counts): the truth is tabulated. enforce_eager stays off (CUDA graphs), to keep the truth's grid to 240
points; block size stays at vLLM's default.

    .venv/bin/python scripts/bench_search.py --seeds 5                 # bench/README.md's table
    .venv/bin/python scripts/bench_search.py --scenario long-docs-32b-h100 --seeds 1 --strategy autotune -v
    .venv/bin/python scripts/bench_search.py --survey                  # the truths only: defaults vs optimum, the
                                                                       # evidence for the utilization rule, and
                                                                       # what an oracle of the constants needs
"""

from __future__ import annotations

import argparse
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
from autotune.engine.failures import LogWatch, classify_exit
from autotune.engine.vllm.failures import PATTERNS
from autotune.engine.vllm.defaults import default_batching
from autotune.measure.metrics import summarize
from autotune.measure.profiles import LoadProfile
from autotune.measure.session import Outcome, Step
from autotune.sim.config import SimConfig
from autotune.sim.perf import API_SERVER, FrontEnd
from autotune.sim.profiles import GpuProfile, gpu_profile, model_shape
from autotune.sim.rank import highest_holding
from autotune.study.advisor import Advisor
from autotune.sim.startup import plan_startup
from autotune.sim.virtual import SimEngine, simulate
from autotune.workload.source import LoadSteps
from autotune.workload.synth import SCENARIOS as WORKLOADS
from autotune.workload.synth import synthesize

ROOT = Path(__file__).resolve().parent.parent
TARGET = 0.95
STEP_S = 60.0  # a load step, as the example studies run it
MAX_STEPS = 4
STOP_S = 5.0  # stopping an engine
MAX_REQUESTS = 400  # a step's requests in virtual time (the product's own cap for predictions)
GRID = 16  # the truth's loads are 2 ** (k / GRID): 4.4 % apart

# The truth's spread (log-normal sigma per constant), from the fidelity table's held-out median errors
# (bench/sim_fidelity.md: throughput 32 %, TTFT 27 %, TPOT 44 %): a constant off by 30 % is one sigma.
SIGMA = math.log(1.3)
NOISE = 0.03  # per-config speed noise: what one config's runs differ by on a GPU (a few percent)
GPU_DRAWN = ("bandwidth_efficiency", "compute_efficiency", "attention_bandwidth_efficiency",
             "attention_compute_efficiency", "host_step_s", "host_seq_s", "allreduce_latency_s")
FRONT_DRAWN = ("request_s", "prompt_token_s", "output_token_s", "latency_s")
_SHARES = {"bandwidth_efficiency", "compute_efficiency", "attention_bandwidth_efficiency",
           "attention_compute_efficiency"}

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


def config_constants(sc: Scenario, seed: int, key: str, noise: bool = True) -> tuple[GpuProfile, FrontEnd]:
    """The truth for one config: the seed's constants, all sped up or slowed down by the config's own noise
    (without it: what an oracle of the seed's constants would predict, ``oracle_picks``)."""
    gpu, front = truth_constants(sc, seed)
    speed = math.exp(float(_rng("noise", sc.name, seed, key).normal(0, NOISE))) if noise else 1.0
    gpu = replace(gpu, **{k: min(getattr(gpu, k) * speed, 0.95) for k in _SHARES if getattr(gpu, k) is not None})
    gpu = replace(gpu, **{k: getattr(gpu, k) / speed for k in ("host_step_s", "host_seq_s", "allreduce_latency_s")})
    front = replace(front, **{k: getattr(front, k) / speed for k in FRONT_DRAWN})
    return gpu, front


def base_workload(sc: Scenario):
    spec = WORKLOADS[sc.workload].with_overrides(**dict(sc.overrides))
    return synthesize(spec, rate=sc.rate, num_requests=sc.requests, seed=0)


def _steps(sc: Scenario) -> LoadSteps:
    return LoadSteps.of(base_workload(sc), STEP_S)


def start_of(sc: Scenario, seed: int, key: str, noise: bool = True):
    """(SimConfig, start-up result, gpu, front) of the truth engine for a config."""
    gpu, front = config_constants(sc, seed, key, noise)
    shape = model_shape(sc.model)
    config = SimConfig.from_args(json.loads(key), gpu, shape)
    return config, plan_startup(shape, gpu, config), gpu, front


def run_step(sc: Scenario, started: tuple, load: float, steps: LoadSteps, slos) -> Any:
    """One load step on a started truth engine (``start_of``'s answer): the step's Summary."""
    config, start, gpu, front = started
    engine = SimEngine(model_shape(sc.model), gpu, config, start.plan, front)
    return summarize(simulate(engine, steps.repeated(load, MAX_REQUESTS), warmup=4), slos)


def true_capacity(job: tuple[Scenario, int, str]) -> dict[str, Any]:
    """A config's row of the truth: its start-up, and the highest load (req/s) meeting every SLO."""
    return _capacity(*job, noise=True)


def noise_free_capacity(job: tuple[Scenario, int, str]) -> dict[str, Any]:
    """A config's row of the truth without the config's own noise: the seed's constants alone."""
    return _capacity(*job, noise=False)


def _capacity(sc: Scenario, seed: int, key: str, noise: bool) -> dict[str, Any]:
    from autotune.measure.slo import parse_slos

    started = start_of(sc, seed, key, noise)
    start = started[1]
    if start.plan is None:
        return {"starts": False, "start_s": start.seconds, "failure": start.failure[0][:200]}
    slos, steps = parse_slos(list(sc.slos)), _steps(sc)

    def holds(k: int) -> bool:
        s = run_step(sc, started, 2 ** (k / GRID), steps, slos)
        return s.failed == 0 and all(v.holds for v in s.verdicts(slos))

    k = highest_holding(holds, -4 * GRID, 4 * GRID, stride=GRID)
    return {"starts": True, "start_s": start.seconds, "capacity": 0.0 if k is None else sc.rate * 2 ** (k / GRID)}


def truth_table(sc: Scenario, seed: int, jobs: int, fresh: bool = False,
                noise: bool = True) -> dict[str, dict[str, Any]]:
    """Every grid config's true capacity for this seed (cached: bench/search-truth/SCENARIO-SEED.json), or
    without the per-config noise (SCENARIO-SEED-noise-free.json)."""
    path = ROOT / "bench" / "search-truth" / f"{sc.name}-{seed}{'' if noise else '-noise-free'}.json"
    keys = grid_keys(sc)
    stamp = {"sigma": SIGMA, "noise": NOISE if noise else 0.0, "grid": GRID, "max_requests": MAX_REQUESTS,
             "scenario": asdict(sc), "truth": [asdict(c) for c in truth_constants(sc, seed)]}

    def compute() -> dict[str, dict[str, Any]]:
        t0 = time.monotonic()
        with multiprocessing.Pool(jobs) as pool:
            rows = dict(zip(keys, pool.map(true_capacity if noise else noise_free_capacity,
                                           [(sc, seed, k) for k in keys], chunksize=2)))
        print(f"  truth {sc.name} seed {seed}{'' if noise else ' (noise-free)'}: {len(rows)} configs in "
              f"{time.monotonic() - t0:.0f} s", file=sys.stderr)
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


# --- measuring on the truth -------------------------------------------------------------------------------------

@dataclass
class Trial:
    key: str
    capacity: float  # the truth's, for the score (0: it did not start)
    gpu_s: float  # what the trial cost, in GPU-seconds


@dataclass
class TruthGpu:
    """The GPU host the strategies measure on: the truth engine, started per trial, its load steps replayed in
    virtual time. ``measure`` has autotune's measure_engine's signature and returns what it would."""

    sc: Scenario
    seed: int
    table: dict[str, dict[str, Any]]
    trials: list[Trial] = field(default_factory=list)
    held_idle_s: float = 0.0  # the study's own CPU time since the last trial (the simulator): the GPU waits

    def __post_init__(self) -> None:
        from autotune.measure.slo import parse_slos

        self.slos = parse_slos(list(self.sc.slos))
        self.steps = _steps(self.sc)

    def row(self, key: str) -> dict[str, Any]:
        if key not in self.table:  # a baseline off the grid (xinference-legacy's 0.7)
            self.table[key] = true_capacity((self.sc, self.seed, key))
        return self.table[key]

    def start(self, key: str) -> dict[str, Any]:
        """Start (and, where it fails, lose) an engine without measuring it: auto_tune's utilization probe."""
        r = self.row(key)
        self._spent(key, 0.0, r["start_s"] + STOP_S)
        return r

    def _spent(self, key: str, capacity: float, engine_s: float) -> None:
        self.trials.append(Trial(key, capacity, (self.held_idle_s + engine_s) * self.sc.gpus))
        self.held_idle_s = 0.0

    def measure(self, command, args: EngineArgs, table, workload_at, slos, profile: LoadProfile, *,
                on_step: Callable[[Outcome], bool] | None = None, **_: Any) -> Outcome:
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
        started = start_of(self.sc, self.seed, key)
        while (load := profile.next_load([(s.load, s.passed) for s in out.steps])) is not None:
            summary = run_step(self.sc, started, load, self.steps, slos)
            out.steps.append(Step(load, self.steps.base.rate * load, summary, summary.verdicts(slos), STEP_S))
            if on_step is not None and on_step(out):
                out.stopped_early = True
                break
        self._spent(key, r["capacity"], r["start_s"] + len(out.steps) * STEP_S + STOP_S)
        return out


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


def run_study(sc: Scenario, gpu: TruthGpu, strategy: str, seed: int, budget: int, say: Callable[[str], None]) -> None:
    """One of autotune's own strategies: the real StudyRun, measuring on the truth."""
    from autotune.sim.advisor import learning_simulator
    from autotune.study import runner
    from autotune.study.definition import load_study
    from autotune.study.storage import open_study

    ours = strategy == "autotune"
    with tempfile.TemporaryDirectory(prefix="bench-search-") as tmp:
        root = Path(tmp)
        path = root / "study.toml"
        path.write_text(study_text(sc, f"{strategy}-{seed}", root, sampler="random" if strategy == "random" else "tpe",
                                   race=ours, baselines=strategy != "random", budget=budget, seed=seed))
        os.environ["AUTOTUNE_STATE_DIR"] = str(root / "state")  # this run's calibration only
        d = load_study(path)
        steps = _steps(sc)
        advisor = None
        if ours:  # as `autotune study` sets a study of real vLLM up on a GPU host: it learns from every trial

            def charge(seconds: float) -> None:
                gpu.held_idle_s += seconds

            shipped, _ = learning_simulator(runner.advisor_target(d, steps))
            advisor = _Charged(shipped, _SHIPPED.setdefault(sc.name, {}), charge)
        run = runner.StudyRun(d, d.command.flag_table(), steps, show=lambda _: None, notice=say, advisor=advisor)
        measure, runner.measure_engine = runner.measure_engine, gpu.measure
        try:
            optuna.logging.set_verbosity(optuna.logging.ERROR)
            run.optimize(open_study(d))
        finally:
            runner.measure_engine = measure


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
    from autotune.measure.profiles import Ladder

    key = key_of(sc, values)
    gpu.measure(None, EngineArgs(json.loads(key)), None, None, gpu.slos, Ladder(1.0, MAX_STEPS, 1.25))


STRATEGIES = ("autotune", "TPE", "random", "auto_tune grid", "bench sweep grid")


def one_run(sc: Scenario, seed: int, strategy: str, budget: int, table: dict, say: Callable[[str], None]) -> TruthGpu:
    gpu = TruthGpu(sc, seed, table)
    if strategy in ("autotune", "TPE", "random"):
        run_study(sc, gpu, strategy, seed, budget, say)
    elif strategy == "auto_tune grid":
        run_auto_tune(sc, gpu, budget)
    else:
        run_sweep(sc, gpu, budget)
    return gpu


def to_target(trials: list[Trial], optimum: float) -> tuple[int | None, float | None]:
    """(real trials, GPU-hours) until a measured config is within TARGET of the optimum; (None, None): never."""
    spent = 0.0
    for i, t in enumerate(trials, 1):
        spent += t.gpu_s
        if t.capacity >= TARGET * optimum:
            return i, spent / 3600
    return None, None


def oracle_picks(table: dict[str, dict[str, Any]], noise_free: dict[str, dict[str, Any]]) -> float:
    """The configs a search that knew this truth's constants (but not each config's own few-percent noise) would
    measure, on average, until one is within TARGET of the optimum: it measures them in the order of their
    noise-free capacity, ties in random order. No strategy that ranks by a model of the GPU can expect fewer,
    however well calibrated; what is left is the noise, which only measuring finds. Exact: a tie of g configs
    holding h hits costs (g + 1) / (h + 1) picks on average before and including the first hit."""
    optimum = max(r.get("capacity", 0.0) for r in table.values())
    ties: dict[float, list[bool]] = {}
    for key, row in noise_free.items():
        ties.setdefault(row.get("capacity", 0.0), []).append(table[key].get("capacity", 0.0) >= TARGET * optimum)
    picks = 0.0
    for capacity in sorted(ties, reverse=True):
        g, h = len(ties[capacity]), sum(ties[capacity])
        if h:
            return picks + (g + 1) / (h + 1)
        picks += g
    return math.inf


def shipped_capacity(job: tuple[Scenario, str]) -> float:
    """The shipped simulator's predicted capacity (req/s) of a config: what autotune ranks by before it has
    measured anything (sim/advisor.simulator with vllm-sim's own constants, as a study builds it on a host with
    no fit yet)."""
    from autotune.measure.slo import parse_slos
    from autotune.sim.advisor import devices_of_profile, simulator
    from autotune.study.advisor import AdvisorTarget

    sc, key = job
    target = AdvisorTarget(sc.model, model_shape(sc.model), "cuda", devices_of_profile(sc.gpu), _steps(sc),
                           parse_slos(list(sc.slos)), "shipped")
    sim, why = simulator(target, calibrated=False)
    assert sim is not None, why
    return sim.one(json.loads(key)).capacity_rps or 0.0


def shipped_table(sc: Scenario, jobs: int) -> dict[str, float]:
    """Every grid config's shipped prediction (cached: bench/search-truth/SCENARIO-shipped.json, stamped with the
    shipped constants, so a new calibration computes it again)."""
    from autotune.sim import rank

    path = ROOT / "bench" / "search-truth" / f"{sc.name}-shipped.json"
    keys = grid_keys(sc)
    stamp = {"scenario": asdict(sc), "gpu": asdict(gpu_profile(sc.gpu)), "front": asdict(API_SERVER),
             "grid": rank.GRID, "max_requests": MAX_REQUESTS}

    def compute() -> dict[str, float]:
        with multiprocessing.Pool(jobs) as pool:
            return dict(zip(keys, pool.map(shipped_capacity, [(sc, k) for k in keys], chunksize=2)))

    return _cached_rows(path, stamp, keys, compute)


def shipped_tie(table: dict[str, dict[str, Any]], noise_free: dict[str, dict[str, Any]],
                shipped: dict[str, float]) -> tuple[int, int, int]:
    """How the shipped simulator's best tie sits in one truth: (its configs, those inside the truth's noise-free
    best tie, those within TARGET of the truth's optimum). All of the first inside means the shipped calibration
    picks as well as an oracle of the truth's constants; the hits among them are then the noise's draw."""
    top = max(shipped.values())
    tie = [k for k, c in shipped.items() if c >= top * (1 - 1e-9)]
    best = max(r.get("capacity", 0.0) for r in noise_free.values())
    optimum = max(r.get("capacity", 0.0) for r in table.values())
    return (len(tie), sum(noise_free[k].get("capacity", 0.0) >= best * (1 - 1e-9) for k in tie),
            sum(table[k].get("capacity", 0.0) >= TARGET * optimum for k in tie))


def oracle_gpu_hours(sc: Scenario, table: dict[str, dict[str, Any]], picks: float) -> float:
    """A floor under the GPU-hours of ``picks`` measured configs: each starts an engine (the grid's median
    start-up) and runs one load step (a race lost at the incumbent's load), the first and the hit two (a capacity
    needs a pass and a miss)."""
    start = statistics.median(r["start_s"] for r in table.values() if r["starts"])
    one = start + STEP_S + STOP_S
    return sc.gpus * (picks * one + (STEP_S if picks <= 1 else 2 * STEP_S)) / 3600


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
        for lo, hi in zip(started, started[1:]):
            both += 1
            better += by_util[hi]["capacity"] >= by_util[lo]["capacity"]
            worse += by_util[hi]["capacity"] < by_util[lo]["capacity"] / 1.1
    return (kept / optimum if optimum else 1.0), (both, better, worse)


def _median(xs: list[float | None], fmt: str, budget: int) -> str:
    m = statistics.median([math.inf if x is None else x for x in xs])
    return f"> {budget} trials" if math.isinf(m) else fmt.format(m)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5, help="truths (and search seeds) per scenario")
    ap.add_argument("--budget", type=int, default=30, help="real trials per search run")
    ap.add_argument("--jobs", type=int, default=max(1, multiprocessing.cpu_count()))
    ap.add_argument("--fresh", action="store_true", help="compute the truth even when cached")
    ap.add_argument("--scenario", action="append", help="only these scenarios")
    ap.add_argument("--strategy", action="append", choices=STRATEGIES, help="only these strategies")
    ap.add_argument("--survey", action="store_true", help="only the truth: defaults vs optimum per seed")
    ap.add_argument("--shipped", action="store_true", help="with --survey: where the shipped simulator's best "
                    "predicted configs sit in each truth (predicts the whole grid: minutes of CPU per scenario)")
    ap.add_argument("--json", type=Path, help="also write every run's trials here")
    ap.add_argument("-v", "--verbose", action="store_true", help="print what autotune's runs say")
    ap.add_argument("--table-from", type=Path, nargs="+", metavar="JSON",
                    help="run nothing: the table of these --json files' runs (a later file's run of the same "
                    "scenario, seed and strategy replaces an earlier one's), and with --json their merge")
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    if a.table_from:
        return table_from(a.table_from, a.json, a.budget)
    say = (lambda m: print(f"    {m}", file=sys.stderr)) if a.verbose else (lambda _: None)
    rows, dump = [], []
    for sc in SCENARIOS:
        if a.scenario and sc.name not in a.scenario:
            continue
        print(f"\n{sc.name}: {sc.model} on {sc.tp}x {sc.gpu}, {sc.workload} at {sc.rate} req/s, SLOs "
              f"{', '.join(sc.slos)}", file=sys.stderr)
        results: dict[str, list[tuple[int | None, float | None]]] = {s: [] for s in STRATEGIES}
        shares, oracles = [], []
        for seed in range(a.seeds):
            table = truth_table(sc, seed, a.jobs, a.fresh)
            optimum = max(r.get("capacity", 0.0) for r in table.values())
            best = max(table, key=lambda k: table[k].get("capacity", 0.0))
            near = sum(1 for r in table.values() if r.get("capacity", 0.0) >= TARGET * optimum)
            share = table[defaults_key(sc)].get("capacity", 0.0) / optimum if optimum else 0.0
            shares.append(share)
            kept, (both, better, worse) = utilization_rule(table)
            print(f"  seed {seed}: optimum {optimum:.2f} req/s ({near} of {len(table)} configs within 95 %), vLLM "
                  f"defaults at {share:.0%}; best {best}", file=sys.stderr)
            print(f"    at the highest utilization that starts: {kept:.1%} of the optimum left; of {both} utilization "
                  f"steps up, {better} hold at least as much, {worse} more than 10 % less", file=sys.stderr)
            if a.survey:
                noise_free = truth_table(sc, seed, a.jobs, a.fresh, noise=False)
                picks = oracle_picks(table, noise_free)
                oracles.append((picks, oracle_gpu_hours(sc, table, picks)))
                print(f"    an oracle of this truth's constants (not of each config's noise) measures {picks:.1f} "
                      f"configs on average to reach 95 % (at least {oracles[-1][1]:.2f} GPU-hours)", file=sys.stderr)
                if a.shipped:
                    n, inside, hits = shipped_tie(table, noise_free, shipped_table(sc, a.jobs))
                    print(f"    the shipped simulator's best: {n} configs tied, {inside} of them in this truth's "
                          f"noise-free best, {hits} within 95 % of its optimum", file=sys.stderr)
                continue
            for strategy in a.strategy or STRATEGIES:
                t0 = time.monotonic()
                gpu = one_run(sc, seed, strategy, a.budget, table, say)
                hit = to_target(gpu.trials, optimum)
                results[strategy].append(hit)
                print(f"    {strategy}: {hit[0] or '-'} trials, {hit[1] or 0:.2f} GPU-h to 95 % "
                      f"({len(gpu.trials)} run, {time.monotonic() - t0:.0f} s)", file=sys.stderr)
                dump.append({"scenario": sc.name, "seed": seed, "strategy": strategy, "optimum": optimum,
                             "defaults_share": share, "trials_to_95": hit[0], "gpu_hours_to_95": hit[1],
                             "trials": [asdict(t) for t in gpu.trials]})
                if a.json:  # after every run: a long benchmark stopped halfway keeps what it measured
                    a.json.write_text(json.dumps(dump, indent=1))
        if oracles:
            print(f"  the oracle's median: {statistics.median(o[0] for o in oracles):.1f} configs, at least "
                  f"{statistics.median(o[1] for o in oracles):.2f} GPU-hours", file=sys.stderr)
        for strategy, hits in results.items():
            if hits:
                rows.append((sc.name, f"{statistics.median(shares):.0%}", strategy,
                             _median([h[0] for h in hits], "{:.0f}", a.budget),
                             _median([h[1] for h in hits], "{:.2f}", a.budget),
                             f"{sum(h[0] is not None for h in hits)}/{len(hits)}"))
    print_table(rows)
    return 0


def summary_rows(dump: list[dict[str, Any]], budget: int) -> list[tuple[str, ...]]:
    """The table's rows of a dump of runs (--json): per scenario and strategy, in the order they first appear."""
    rows = []
    for name in dict.fromkeys(d["scenario"] for d in dump):
        runs = [d for d in dump if d["scenario"] == name]
        shares = {d["seed"]: d["defaults_share"] for d in runs}
        for strategy in sorted({d["strategy"] for d in runs}, key=STRATEGIES.index):
            hits = [(d["trials_to_95"], d["gpu_hours_to_95"]) for d in runs if d["strategy"] == strategy]
            rows.append((name, f"{statistics.median(shares.values()):.0%}", strategy,
                         _median([h[0] for h in hits], "{:.0f}", budget),
                         _median([h[1] for h in hits], "{:.2f}", budget),
                         f"{sum(h[0] is not None for h in hits)}/{len(hits)}"))
    return rows


def table_from(paths: list[Path], out: Path | None, budget: int) -> int:
    merged: dict[tuple[str, int, str], dict[str, Any]] = {}
    for path in paths:
        for run in json.loads(path.read_text()):
            merged[(run["scenario"], run["seed"], run["strategy"])] = run
    dump = list(merged.values())
    if out is not None:
        out.write_text(json.dumps(dump, indent=1))
    print_table(summary_rows(dump, budget))
    return 0


def print_table(rows: list[tuple[str, ...]]) -> None:
    if rows:
        print("\n| scenario | defaults / optimum (median) | strategy | median real trials to 95 % "
              "| median GPU-hours to 95 % | runs that got there |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    sys.exit(main())
