"""How many trials does the search need to find a near-optimal vLLM config? (vllm-sim, virtual time)

For three scenarios, each on its own model and GPU profile:
1. the truth: every point of a discretized engine-arg space is simulated (autotune.sim.virtual)
   and its SLO capacity found by bisection over the load; the best is the optimum;
2. three strategies, ten seeds each, run against that table: autotune's study strategy (the
   runner's TPE sampler with constraints, the baselines enqueued first, the pre-check), Optuna's
   random search, and the grid of vLLM's benchmarks/auto_tune (max_num_seqs x
   max_num_batched_tokens at the highest gpu_memory_utilization that starts, found from the top
   down by failed starts, everything else at vLLM's defaults; its order is fixed, so its seeds agree);
3. the median number of trials, and of engine seconds (start-ups, failed ones included, plus
   the load steps of a measured trial), until a trial reaches 95 % of the optimum's capacity.

A trial's value is the table's capacity: the benchmark measures the search, not measurement
noise. Start-up seconds come from the simulated start-up (vllm-sim's model, time scale 1);
a measured trial adds MEASURE_S (4 load steps of 60 s, as the example studies run).

    .venv/bin/python scripts/bench_search.py                 # table; truth cached under bench/
    .venv/bin/python scripts/bench_search.py --fresh --jobs 2
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import optuna

from autotune.engine.args import EngineArgs
from autotune.engine.vllm.defaults import default_batching
from autotune.study.baselines import baseline_points
from autotune.engine.vllm.precheck import precheck
from autotune.study.runner import NO_MEASUREMENT, make_sampler
from autotune.study.space import Param, Space
from autotune.sim.config import SimConfig
from autotune.sim.profiles import gpu_profile, model_shape
from autotune.sim.startup import plan_startup
from autotune.sim.virtual import SimEngine, simulate
from autotune.measure.metrics import summarize
from autotune.measure.slo import parse_slos
from autotune.workload.synth import synthesize

ROOT = Path(__file__).resolve().parent.parent
MEASURE_S = 4 * 60.0
LADDER = 1.03  # load steps of the truth's bisection: capacity is known to 3 %
TARGET = 0.95


@dataclass(frozen=True)
class Scenario:
    name: str
    model: str
    gpu: str
    tp: int
    max_model_len: int
    slos: tuple[str, ...]
    workload: str
    rate: float  # req/s at load 1, near the defaults' capacity: the search gallops from there (x1/16..x8)
    requests: int  # per load step, the same ones at every load


SCENARIOS = (
    Scenario("chat", "llama-3.1-8b", "l20-48gb", 1, 8192, ("ttft<800ms", "tpot<60ms"), "chat", 4.0, 200),
    Scenario("long-docs", "qwen2.5-32b", "h100-80gb", 1, 16384, ("ttft<3s", "tpot<80ms"), "long-docs", 0.4, 60),
    Scenario("high-concurrency", "llama-3.1-70b", "a100-80gb", 4, 8192, ("ttft<500ms", "tpot<60ms"),
             "high-concurrency", 20.0, 300),
)


UTILIZATIONS = (0.85, 0.90, 0.92, 0.95)
SEQS = (32, 64, 128, 256, 512, 1024)
TOKENS = (2048, 4096, 8192, 16384)


def space_of(sc: Scenario) -> Space:
    """The CUDA default space of a study (numeric knobs, as TPE models them), on narrower ranges."""
    gpu = gpu_profile(sc.gpu)
    seqs, tokens = default_batching("cuda", gpu.memory_bytes / (1 << 30), gpu.name)
    params = (
        Param("gpu_memory_utilization", "float", 0.92, low=0.85, high=0.95, step=0.01),
        Param("max_num_seqs", "int", seqs, low=32, high=1024, log=True),
        Param("max_num_batched_tokens", "int", tokens, low=2048, high=16384, log=True),
        Param("enable_chunked_prefill", "bool", True),
        Param("enable_prefix_caching", "bool", True),
        Param("enforce_eager", "bool", False),
    )
    fixed = EngineArgs({"max_model_len": sc.max_model_len, "tensor_parallel_size": sc.tp})
    return Space(params, "cuda", fixed, sc.max_model_len)


def snap(values: dict) -> dict:
    """A sampled point onto the grid the truth was computed on (nearest, log scale for counts)."""
    out = dict(values)
    out["gpu_memory_utilization"] = min(UTILIZATIONS, key=lambda u: abs(u - values["gpu_memory_utilization"]))
    for name, grid in (("max_num_seqs", SEQS), ("max_num_batched_tokens", TOKENS)):
        out[name] = min(grid, key=lambda g: abs(math.log(g) - math.log(values[name])))
    return out


def grid(space: Space) -> list[dict]:
    axes = {"gpu_memory_utilization": UTILIZATIONS, "max_num_seqs": SEQS, "max_num_batched_tokens": TOKENS}
    names = space.names()
    return [dict(zip(names, combo)) for combo in itertools.product(*[axes.get(n, (False, True)) for n in names])]


def config_of(sc: Scenario, args: EngineArgs) -> SimConfig:
    return SimConfig.from_args(args.values, gpu_profile(sc.gpu), model_shape(sc.model))


# --- the truth ----------------------------------------------------------------------------

@lru_cache(maxsize=None)
def _workload(sc: Scenario, k: int):
    # the same requests at every load, only closer together: common random numbers keep the
    # verdict monotone in the load, so the bisection finds one well-defined capacity
    base = synthesize(sc.workload, rate=sc.rate, num_requests=sc.requests, seed=0)
    return base.scaled(LADDER**k)


def evaluate(job: tuple[Scenario, SimConfig]) -> dict:
    """Start-up, then the highest ladder load meeting every SLO (bisection: capacity is monotone in load)."""
    sc, cfg = job
    shape, gpu = model_shape(sc.model), gpu_profile(sc.gpu)
    start = plan_startup(shape, gpu, cfg)
    if start.plan is None:
        return {"oom": True, "start_s": start.seconds, "failure": start.failure[0][:120]}
    slos = parse_slos(list(sc.slos))

    def holds(k: int) -> bool:
        s = summarize(simulate(SimEngine(shape, gpu, cfg, start.plan), _workload(sc, k), warmup=4), slos)
        return s.failed == 0 and all(v.holds for v in s.verdicts(slos))

    # gallop from the scenario's load 1 in strides of 8 ladder steps (x1.27), then bisect the stride
    floor, ceiling = -round(math.log(16) / math.log(LADDER)), round(math.log(8) / math.log(LADDER))
    k = 0
    if holds(k):
        lo = k
        while lo < ceiling and holds(min(lo + 8, ceiling)):
            lo = min(lo + 8, ceiling)
        hi = lo + 8
    else:
        hi = k
        while hi > floor and not holds(max(hi - 8, floor)):
            hi = max(hi - 8, floor)
        lo = hi - 8
        if hi == floor:
            return {"oom": False, "start_s": start.seconds, "capacity": 0.0}
    if lo >= ceiling:
        return {"oom": False, "start_s": start.seconds, "capacity": sc.rate * LADDER**ceiling}
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if holds(mid) else (lo, mid)
    return {"oom": False, "start_s": start.seconds, "capacity": sc.rate * LADDER**lo}


def truth(sc: Scenario, jobs: int, fresh: bool) -> dict[SimConfig, dict]:
    path = ROOT / "bench" / f"search-truth-{sc.name}.json"
    space = space_of(sc)
    configs = {}
    for values in grid(space):
        configs[config_of(sc, space.engine_args(values))] = None
    if path.exists() and not fresh:
        rows = json.loads(path.read_text())
        table = {SimConfig(**r["config"]): r["result"] for r in rows}
        if set(table) >= set(configs):
            return table
    t0 = time.monotonic()
    todo = [(sc, c) for c in configs]
    with multiprocessing.Pool(jobs) as pool:
        results = pool.map(evaluate, todo, chunksize=4)
    table = {c: r for (_, c), r in zip(todo, results)}
    path.parent.mkdir(exist_ok=True)
    from dataclasses import asdict
    path.write_text(json.dumps([{"config": asdict(c), "result": r} for c, r in table.items()], indent=0))
    print(f"{sc.name}: {len(table)} distinct configs simulated in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return table


# --- the strategies -------------------------------------------------------------------------

@dataclass
class Run:
    capacities: list[float]  # per trial, in order; 0 for failed starts and SLO misses
    engine_s: list[float]

    def to_target(self, optimum: float) -> tuple[int | None, float | None]:
        spent = 0.0
        for i, (c, s) in enumerate(zip(self.capacities, self.engine_s)):
            spent += s
            if c >= TARGET * optimum:
                return i + 1, spent
        return None, None


def lookup(sc: Scenario, table: dict, cfg: SimConfig) -> dict:
    """A config of the table, or one outside the grid (a baseline such as xinference-legacy's 0.7), simulated now."""
    if cfg not in table:
        table[cfg] = evaluate((sc, cfg))
    return table[cfg]


def _cost(r: dict) -> float:
    return r["start_s"] + (0.0 if r["oom"] else MEASURE_S)


def run_optuna(sc: Scenario, table: dict, sampler: str, seed: int, budget: int, with_study_extras: bool) -> Run:
    """autotune's study strategy (with_study_extras: baselines first, the pre-check) or plain random search."""
    space = space_of(sc)
    shape, gpu = model_shape(sc.model), gpu_profile(sc.gpu)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study(direction="maximize", sampler=make_sampler(sampler, seed))
    if with_study_extras:
        for b in baseline_points(space, ("vllm-defaults", "xinference-4.1", "xinference-legacy"), []):
            study.enqueue_trial(b.params, user_attrs={"baseline_args": b.extra_args})
    n_slos = len(sc.slos)
    run = Run([], [])
    for _ in range(budget):
        trial = study.ask()
        values = snap(space.sample(trial))
        args = space.engine_args(values, trial.user_attrs.get("baseline_args") or {})
        if with_study_extras and precheck(shape, args, "cuda", gpu.memory_bytes) is not None:
            trial.set_user_attr("constraints", [NO_MEASUREMENT] * n_slos)
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            run.capacities.append(0.0)
            run.engine_s.append(0.0)
            continue
        r = lookup(sc, table, config_of(sc, args))
        run.engine_s.append(_cost(r))
        if r["oom"]:
            trial.set_user_attr("constraints", [NO_MEASUREMENT] * n_slos)
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            run.capacities.append(0.0)
            continue
        cap = r["capacity"]
        # feasible at its capacity; a config that meets no SLO at the lowest load misses them
        trial.set_user_attr("constraints", [-1.0] * n_slos if cap > 0 else [1.0] * n_slos)
        study.tell(trial, cap)
        run.capacities.append(cap)
    return run


def run_grid(sc: Scenario, table: dict, budget: int) -> Run:
    """benchmarks/auto_tune: the highest utilization that starts (0.95 down), then max_num_seqs x max_num_batched_tokens."""
    space = space_of(sc)
    run = Run([], [])
    seqs, tokens = SEQS, TOKENS
    defaults = {p.name: p.default for p in space.params}
    util = None
    for u in (0.95, 0.92, 0.90, 0.85):  # the space's utilizations, top down, at vLLM's default batching
        r = table[config_of(sc, space.engine_args({**defaults, "gpu_memory_utilization": u}))]
        run.engine_s.append(r["start_s"])
        run.capacities.append(0.0)  # auto_tune only starts the server here, it measures nothing
        if not r["oom"]:
            util = u
            break
    if util is None:
        return run
    for s, t in itertools.product(seqs, tokens):
        if len(run.capacities) >= budget:
            break
        if t < s:
            continue  # vLLM refuses it; auto_tune's lists avoid it
        r = table[config_of(sc, space.engine_args({**defaults, "gpu_memory_utilization": util,
                                                   "max_num_seqs": s, "max_num_batched_tokens": t}))]
        run.engine_s.append(_cost(r))
        run.capacities.append(0.0 if r["oom"] else r["capacity"])
    return run


def _median(xs: list[float | None], budget: int, scale: float = 1.0, fmt: str = "{:.0f}") -> str:
    """The median over seeds; a run that never got there counts as infinitely long."""
    m = statistics.median([math.inf if x is None else x / scale for x in xs])
    return f"> {budget} trials" if math.isinf(m) else fmt.format(m)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--budget", type=int, default=100, help="trials per search run")
    ap.add_argument("--jobs", type=int, default=max(1, multiprocessing.cpu_count()))
    ap.add_argument("--fresh", action="store_true", help="re-simulate the truth even when cached")
    ap.add_argument("--scenario", action="append", help="only these scenarios")
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    rows = []
    for sc in SCENARIOS:
        if a.scenario and sc.name not in a.scenario:
            continue
        table = truth(sc, a.jobs, a.fresh)
        feasible = [r for r in table.values() if not r["oom"]]
        optimum = max(r["capacity"] for r in feasible)
        best = next(c for c, r in table.items() if not r["oom"] and r["capacity"] == optimum)
        near = sum(1 for r in feasible if r["capacity"] >= TARGET * optimum)
        defaults = table[config_of(sc, space_of(sc).engine_args({p.name: p.default for p in space_of(sc).params}))]
        print(f"\n{sc.name}: {sc.model} on {sc.tp}x {sc.gpu}, SLOs {', '.join(sc.slos)}; {len(table)} configs, "
              f"{len(table) - len(feasible)} fail to start, {near} within 95 % of the optimum {optimum:.2f} req/s "
              f"(vLLM defaults: {defaults.get('capacity', 0.0):.2f})")
        print(f"  optimum: util {best.gpu_memory_utilization}, max_num_seqs {best.max_num_seqs}, "
              f"max_num_batched_tokens {best.max_num_batched_tokens}, chunked {best.enable_chunked_prefill}, "
              f"prefix caching {best.enable_prefix_caching}, eager {best.enforce_eager}")
        results = {
            "autotune (TPE + baselines)": [run_optuna(sc, table, "tpe", s, a.budget, True) for s in range(a.seeds)],
            "random search": [run_optuna(sc, table, "random", s, a.budget, False) for s in range(a.seeds)],
            "auto_tune grid": [run_grid(sc, table, a.budget)] * a.seeds,
        }
        for name, runs in results.items():
            hits = [r.to_target(optimum) for r in runs]
            trials, secs = [h[0] for h in hits], [h[1] for h in hits]
            reached = sum(t is not None for t in trials)
            rows.append((sc.name, name, _median(trials, a.budget), _median(secs, a.budget, 3600, "{:.1f}"),
                         f"{reached}/{len(runs)}"))
    print("\n| scenario | strategy | median trials to 95 % | median engine hours to 95 % | runs that got there |")
    print("|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
