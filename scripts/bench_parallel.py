"""Wall clock and GPU-hours until a study hands a user a near-optimal config, with 1, 2, 4 and 8 GPUs on the host.

The truths, the noise and the score are scripts/bench_search.py's (its cached truth tables, its common random
numbers, its declared-config score); what changes is the host: the study gets ``[engine] gpus = "0-(N-1)"`` and
runs as many trials side by side as N GPUs hold (N // the scenario's tensor parallel size), each on GPUs of its
own (study/slots.py). The trials run in virtual time, as a discrete-event simulation of the real runner: the
runner's own ``measure_trial`` (study/sidebyside.py) runs a trial's objective when it starts (sampling, the race,
the simulator's advice, what it measures on the truth) and its ``end_trial`` tells Optuna and runs the study's
callbacks (the simulator's refit, the declared winner) once the trial's GPU time has passed, so a trial started
meanwhile sees it still running (TPE's constant liar) as on a real host. One difference: a config sampled while
the same one is measured beside it is measured again here (the real runner waits for that result), which costs
the parallel runs GPU time the real ones do not spend. A trial's duration is its truth GPU time per
GPU: its engine start, load steps and stop, and the simulator's CPU seconds before it (the GPU waits for them).
With N = TP the simulation is the sequential study; the script checks it trial for trial against bench_search's
own run (the first line it prints). The re-measurement after the search runs as many runs at once as the GPUs
hold (``StudyRun.side_by_side``, here placed together on the clock).

Per run: the wall-clock hours and the GPU-hours (every GPU a trial holds, failed starts included) until the
declared config is within 95 % of the optimum and stays there to the end (a run that never gets there counts at
the cap, 2 hours of wall clock and 2 GPU-hours per engine GPU, in the restricted means); and the wall clock to
the study's verdict (its budget of trials and its re-measurement: what a user waits for) and the study's
GPU-hours (what a user pays). Per scenario and N: the means with bootstrap 95 % intervals over truths, and the
paired ratios against the one-engine study on the same truths.

    .venv/bin/python scripts/bench_parallel.py --scenario chat-8b-l20 --seeds 3 --json bench/parallel-runs.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

from autotune.study import sidebyside

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_search as bench
import search_scores

GPU_COUNTS = (1, 2, 4, 8)
CAP_H = search_scores.CAP  # the restricted means' horizon: hours of wall clock, GPU-hours per engine GPU


@dataclass
class Clock:
    """The virtual host's time, and every trial's GPU interval on it."""

    now: float = 0.0
    spans: list[tuple[float, float, float]] = field(default_factory=list)  # (start s, end s, GPU-seconds)
    declared: list[tuple[float, str | None]] = field(default_factory=list)  # (wall s, config)
    search_end: float = 0.0  # when the last trial ended; the re-measurement follows
    batch_start: float = 0.0  # the re-measurement's runs at once (StudyRun.side_by_side) start together
    batch_end: float = 0.0

    def gpu_hours(self, at: float) -> float:
        """GPU-hours spent by ``at`` (a trial running then counts for the part of it done)."""
        spent = 0.0
        for start, end, gpu_s in self.spans:
            if at >= end:
                spent += gpu_s
            elif at > start:
                spent += gpu_s * (at - start) / (end - start)
        return spent / 3600


def drive(clock: Clock, gpu: bench.TruthGpu):
    """``StudyRun.optimize`` side by side in virtual time (the module's docstring)."""

    def runs_at_once(runs: list[Any]) -> list[Any]:
        """The re-measurement's runs side by side, measured one after the other and placed together on the clock."""
        clock.batch_start = clock.batch_end = clock.now
        outs = [run() for run in runs]
        clock.now = clock.batch_end
        return outs

    def run_trials(run: Any, study: optuna.Study) -> None:
        run.side_by_side = runs_at_once
        run.prepare(study)
        callbacks = run.trial_callbacks()
        jobs, left = run.concurrency, run.remaining(study)
        running: list[tuple[float, int, Any, Any]] = []  # a heap of (end s, trial number, trial, its end)
        asked = 0
        while True:
            while len(running) < jobs and asked < left and run.remaining(study) > len(running):
                trial = study.ask()
                before = len(gpu.trials)
                end = sidebyside.measure_trial(run, trial)
                gpu_s = sum(t.gpu_s for t in gpu.trials[before:])
                finish = clock.now + gpu_s / gpu.sc.gpus
                clock.spans.append((clock.now, finish, gpu_s))
                heapq.heappush(running, (finish, trial.number, trial, end))
                asked += 1
            if not running:
                clock.search_end = clock.now
                return
            clock.now, _, trial, end = heapq.heappop(running)
            sidebyside.end_trial(run, study, trial, end, callbacks)

    return run_trials


class ClockedGpu(bench.TruthGpu):
    """The truth GPU of bench_search, its declarations stamped with the virtual wall clock, and what it measures
    after the search (the re-measurement's runs at once) placed on the clock from the start of their batch."""

    clock: Clock

    def declare(self, key: str | None) -> None:
        super().declare(key)
        self.clock.declared.append((self.clock.now, key))

    def _spent(self, key: str, measured: float, engine_s: float) -> None:
        super()._spent(key, measured, engine_s)
        if self.confirming:
            gpu_s = self.trials[-1].gpu_s
            end = self.clock.batch_start + gpu_s / self.sc.gpus
            self.clock.spans.append((self.clock.batch_start, end, gpu_s))
            self.clock.batch_end = max(self.clock.batch_end, end)


@dataclass(frozen=True)
class ParallelRun:
    scenario: str
    seed: int
    strategy: str
    gpus: int  # the host's
    engines: int  # trials side by side
    wall_h_to_95: float | None
    gpu_h_to_95: float | None
    wall_h: float  # the run's end: its verdict
    search_h: float  # when its trials ended (the re-measurement is the rest)
    gpu_h: float
    declared_share: float
    trials: list[str]  # the configs measured, in order


def one(truth: bench.Truth, strategy: str, gpus: int, budget: int, table: dict[str, Any]) -> ParallelRun:
    clock = Clock()
    gpu = ClockedGpu(truth, table)
    gpu.clock = clock
    bench.run_study(truth.sc, gpu, strategy, truth.seed, budget, lambda _: None, gpus=gpus,
                    drive=drive(clock, gpu))
    optimum = max(r.get("capacity", 0.0) for r in table.values())
    points = [(at / 3600, round((table[k].get("capacity", 0.0) if k else 0.0) / optimum, 2))
              for at, k in clock.declared]
    points.append((clock.now / 3600, points[-1][1] if points else 0.0))
    wall = search_scores.hours_to_target(points)
    return ParallelRun(truth.sc.name, truth.seed, strategy, gpus, gpus // truth.sc.gpus, wall,
                       None if wall is None else clock.gpu_hours(wall * 3600), clock.now / 3600,
                       clock.search_end / 3600, clock.gpu_hours(clock.now), points[-1][1], [t.key for t in gpu.trials])


def restricted_wall(r: ParallelRun) -> float:
    return CAP_H if r.wall_h_to_95 is None else min(r.wall_h_to_95, CAP_H)


def restricted_gpu(r: ParallelRun, tp: int) -> float:
    return CAP_H if r.gpu_h_to_95 is None else min(r.gpu_h_to_95 / tp, CAP_H)


def rows(runs: list[ParallelRun]) -> list[tuple[str, ...]]:
    """Per scenario, strategy and host, then pooled over the scenarios of one tensor parallel size: the restricted
    means and their paired ratios to one engine on the same truths (bootstrap over truths, within scenarios)."""
    tp = {sc.name: sc.gpus for sc in bench.SCENARIOS}
    out = []
    for name, strategy in sorted({(r.scenario, r.strategy) for r in runs}):
        out += _rows(name, strategy, [r for r in runs if r.scenario == name and r.strategy == strategy], tp)
    for size in sorted({tp[r.scenario] for r in runs}):
        names = sorted({r.scenario for r in runs if tp[r.scenario] == size})
        for strategy in sorted({r.strategy for r in runs}):
            mine = [r for r in runs if r.scenario in names and r.strategy == strategy]
            if len(names) > 1 and mine:
                out += _rows(f"pooled: {len(names)} TP-{size} scenarios", strategy, mine, tp)
    return out


def _rows(label: str, strategy: str, mine: list[ParallelRun], tp: dict[str, int]) -> list[tuple[str, ...]]:
    base = {(r.scenario, r.seed): r for r in mine if r.engines == 1}
    names = sorted({r.scenario for r in mine})
    out = []
    for g in sorted({r.gpus for r in mine}):
        at = [r for r in mine if r.gpus == g and (r.scenario, r.seed) in base]

        def groups(read, at=at):
            return [[read(r, base[r.scenario, r.seed]) for r in at if r.scenario == n] for n in names]

        wall = search_scores.bootstrap(groups(lambda r, _: restricted_wall(r)), search_scores.mean)
        gpuh = search_scores.bootstrap(groups(lambda r, _: restricted_gpu(r, tp[r.scenario])), search_scores.mean)
        ratios = [search_scores.bootstrap(groups(read), search_scores.ratio_of_means) for read in (
            lambda r, b: (restricted_wall(r), restricted_wall(b)),
            lambda r, b: (restricted_gpu(r, tp[r.scenario]), restricted_gpu(b, tp[r.scenario])),
            lambda r, b: (r.wall_h, b.wall_h),
            lambda r, b: (r.gpu_h, b.gpu_h),
        )]
        got = sum(r.wall_h_to_95 is not None for r in at)
        out.append((label, strategy, f"{g} ({at[0].engines} at once)", f"{got}/{len(at)}", _iv(wall), _iv(gpuh),
                    _iv(ratios[0], "x"), _iv(ratios[1], "x"),
                    f"{search_scores.mean([r.wall_h for r in at]):.2f} "
                    f"({search_scores.mean([r.search_h for r in at]):.2f})",
                    _iv(ratios[2], "x"), _iv(ratios[3], "x")))
    return out


def _iv(i: search_scores.Interval, unit: str = "") -> str:
    return f"{i.value:.2f}{unit} [{i.low:.2f}, {i.high:.2f}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", action="append", help="only these scenarios (default: every one)")
    ap.add_argument("--seeds", type=int, default=3, help="truths (and search seeds) per scenario")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--strategy", action="append", choices=("autotune", "TPE"), help="default: both")
    ap.add_argument("--budget", type=int, default=15, help="trials per study, as bench_search's")
    ap.add_argument("--jobs", type=int, default=2, help="processes computing a truth table that is not cached")
    ap.add_argument("--json", type=Path, help="write every run here")
    ap.add_argument("--table-from", type=Path, help="run nothing: the table of this --json file")
    a = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    if a.table_from:
        runs = [ParallelRun(**r) for r in json.loads(a.table_from.read_text())]
    else:
        runs = []
        for sc in bench.SCENARIOS:
            if a.scenario and sc.name not in a.scenario:
                continue
            for seed in range(a.first_seed, a.first_seed + a.seeds):
                truth = bench.truth_of(sc, seed)
                table = bench.truth_table(truth, a.jobs)
                for strategy in a.strategy or ("autotune", "TPE"):
                    for g in (g for g in GPU_COUNTS if g >= sc.gpus):
                        t0 = time.monotonic()
                        r = one(truth, strategy, g, a.budget, table)
                        if g == sc.gpus:  # the simulation of one engine is the sequential study
                            seq = bench.one_run(truth, strategy, a.budget, table, lambda _: None)
                            same = [t.key for t in seq.trials] == r.trials
                            said = "measures what the sequential study measures" if same else "DIFFERS from it"
                            print(f"  {sc.name} seed {seed} {strategy}: one engine in virtual time {said} "
                                  f"({len(r.trials)} measurements)", file=sys.stderr)
                        runs.append(r)
                        wall = "-" if r.wall_h_to_95 is None else f"{r.wall_h_to_95:.2f}"
                        gpuh = "-" if r.gpu_h_to_95 is None else f"{r.gpu_h_to_95:.2f}"
                        print(f"    {g} GPUs ({r.engines} at once): within 95 % for good after {wall} h wall, "
                              f"{gpuh} GPU-h; ends at {r.wall_h:.2f} h (trials {r.search_h:.2f} h), "
                              f"{r.gpu_h:.2f} GPU-h, declaring {r.declared_share:.0%} "
                              f"({time.monotonic() - t0:.0f} s)", file=sys.stderr)
                        if a.json:
                            a.json.write_text(json.dumps([r.__dict__ for r in runs], indent=1))
    search_scores.print_rows(
        ("scenario", "strategy", "GPUs", "got to 95 %", "wall h to 95 % (restricted mean)",
         "GPU-h per engine GPU to 95 %", "wall to 95 % vs one engine", "GPU-h to 95 % vs one engine",
         "wall h to the verdict (of it, trials), mean", "wall to the verdict vs one engine",
         "the study's GPU-h vs one engine"),
        rows(runs),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
