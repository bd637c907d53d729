"""What a person sees: tables and progress on the terminal (rich). Results go to stdout, chatter to stderr."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from optuna.trial import TrialState
from rich.console import Console
from rich.table import Table

from autotune.measure.session import Outcome
from autotune.measure.tables import outcome_tables
from autotune.study.lines import capacity_text, elapsed_text, gain_text, same_trial, trial_line
from autotune.study.records import Remeasurement, StepRecord, StudyResult, TrialRecord, held_every_load

if TYPE_CHECKING:
    from autotune.publish.history import Entry

out = Console()
err = Console(stderr=True)
for _console in (out, err):
    if not _console.is_terminal:  # a pipe or the journal: tables as wide as their content needs, not 80 columns
        _console.width = 200


def print_result(result: Outcome) -> None:
    """A single-load session (bench, replay): engine start, throughput, latency, failed requests, SLOs."""
    if result.failure is not None:
        f = result.failure
        err.print(f"[bold red]engine failed: {f.failure_class.value}[/] - {f.summary}")
        if f.excerpt:
            err.print(f.excerpt, markup=False, highlight=False)
        logs = [str(p) for p in result.log_paths.values() if p.exists()]
        if logs:
            err.print(f"the engine's whole output: {', '.join(logs)}", markup=False, highlight=False)
    start = None if result.engine_ready_s is None else f"{result.engine_ready_s:.1f} s"
    for table in outcome_tables(result, start):
        out.print(table)


def trial_event(r: TrialRecord, reference: TrialRecord | None) -> dict:
    """The same trial for machines (``autotune study --json``): one JSON object per line."""
    return {
        "event": "trial",
        "number": r.number,
        "label": r.label,
        "chosen_because": r.chosen_because,
        "state": r.state.name.lower(),
        "params": r.params,
        "config": r.config,
        "feasible": r.feasible,
        "capacity_rps": r.capacity_rps,
        "capacity_output_tok_s": r.capacity_output_tok_s,
        "failure_class": r.failure_class,
        "failure": r.failure or None,
        "wall_s": r.wall_s,
        "race": None if r.race is None else r.race.to_json(),
        "gain_over": reference.label if reference is not None and not same_trial(r, reference) else None,
        "capacity_at_least": r.capacity_at_least,
        "gain": (r.capacity_rps / reference.capacity_rps - 1)
        if reference is not None
        and not same_trial(r, reference)
        and reference.capacity_rps > 0
        and not reference.capacity_at_least
        and r.feasible
        else None,
    }


@dataclass(frozen=True)
class Progress:
    """Where a study stands after a trial: what the footer says."""

    done: int
    budget: int | None
    best: TrialRecord | None
    reference: TrialRecord | None
    engine_s: float  # engine time spent on the trials so far (GPU time: times the trial's GPUs)
    gpu: bool
    remeasure_runs: int = 0  # the runs the re-measurement after the last trial will make (each a fresh engine)

    @classmethod
    def of(cls, result: StudyResult, budget: int | None, gpu: bool, remeasure_runs: int = 0) -> Progress:
        finished = [r for r in result.records if r.state in (TrialState.COMPLETE, TrialState.PRUNED)]
        spent = sum(r.gpu_s if gpu else r.wall_s for r in result.records)
        return cls(len(finished), budget, result.best, result.best_baseline, spent, gpu, remeasure_runs)

    @property
    def left_s(self) -> float | None:
        """Trials left and the re-measurement's runs, each at the mean trial so far (None: nothing to go on, or no
        trial budget). A re-measurement run is a trial's work again: an engine start and a ladder of loads."""
        if self.budget is None or self.done == 0:
            return None
        return (max(self.budget - self.done, 0) + self.remeasure_runs) * self.engine_s / self.done

    def text(self) -> str:
        of = f"/{self.budget}" if self.budget else ""
        best = "no trial within the SLOs yet"
        if self.best is not None:
            best = f"{capacity_text(self.best)} (trial {self.best.number}"
            gain = "" if same_trial(self.best, self.reference) else gain_text(self.best, self.reference)
            best += gain + ")"
        spent = f"{'GPU' if self.gpu else 'engine'} time {elapsed_text(self.engine_s)}"
        left = ""
        if self.left_s is not None:
            runs = f" with at most {self.remeasure_runs} re-measurement runs" if self.remeasure_runs else ""
            left = f", about {elapsed_text(self.left_s)} left{runs}"
        return f"{self.done}{of} trials; best {best}; {spent}{left}"


class StudyView:
    """What a person sees while a study runs.

    On a terminal: each finished trial as one line above a live footer (the current phase;
    trials done, the best so far and its gain, GPU time spent and left). Elsewhere (CI,
    journald): the same trial lines and a progress line after each, timestamped, no footer.
    With ``json_lines``: one JSON object per trial and one for the result on stdout, nothing
    else there. Optuna's own log lines go to the study's log file, never to the console.
    """

    def __init__(
        self,
        name: str,
        budget: int | None,
        log_file: Path,
        *,
        gpu: bool = True,
        json_lines: bool = False,
        remeasure_runs: int = 0,
    ) -> None:
        self.name, self.budget, self.gpu, self.json_lines = name, budget, gpu, json_lines
        self.remeasure_runs = remeasure_runs  # what the re-measurement will run after the trials (Progress)
        self.log_file = log_file
        self.phase = "starting"
        self.progress = Progress(0, budget, None, None, 0.0, gpu)
        self._live = None
        if err.is_terminal and not json_lines:
            from rich.live import Live

            self._live = Live(console=err, transient=True, auto_refresh=False)
        self._logging = _StudyLog(log_file)

    def __enter__(self) -> StudyView:
        self._logging.__enter__()
        if self._live is not None:
            self._live.__enter__()
            self._refresh()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._live is not None:
            self._live.__exit__(exc_type, exc, tb)
        self._logging.__exit__(exc_type, exc, tb)

    def show(self, line: str) -> None:
        """A phase of the running trial (engine starting, a load step): the footer, and the study's log."""
        self.phase = line
        self._logging.log(line)
        if self._live is not None:
            self._refresh()

    def notice(self, line: str) -> None:
        """A line a person must read whatever the mode: on stderr (JSON mode keeps stdout to its objects)."""
        self._logging.log(line)
        err.print(f"autotune: {line}", markup=False, highlight=False)

    def trial_done(self, record: TrialRecord, result: StudyResult) -> None:
        import json
        import time

        reference = result.best_baseline
        self.progress = Progress.of(result, self.budget, self.gpu, self.remeasure_runs)
        line = trial_line(record, reference)
        self._logging.log(line)
        if self.json_lines:
            print(json.dumps(trial_event(record, reference)), flush=True)
        elif self._live is not None:
            err.print(line, markup=False, highlight=False)
            self._refresh()
        else:  # the journal: whole lines, never wrapped at a terminal width there is none of
            stamp = time.strftime("%H:%M:%S")
            print(f"{stamp} {line}\n{stamp} {self.progress.text()}", file=sys.stderr, flush=True)

    def _refresh(self) -> None:
        from rich.text import Text

        assert self._live is not None  # called only with a live footer

        of = f" ({self.budget} trials)" if self.budget else ""
        footer = Text.assemble(
            (f"autotune study {self.name}{of}: ", "bold"), self.phase, "\n", (self.progress.text(), "dim")
        )
        self._live.update(footer, refresh=True)


class _StudyLog:
    """The study's log file gets Optuna's log lines and ours; Optuna's go nowhere else."""

    def __init__(self, path: Path) -> None:
        import logging

        self.path = path
        self.logger = logging.getLogger("autotune.study")
        self._handler: logging.Handler | None = None
        self._console: logging.Handler | None = None

    def __enter__(self) -> _StudyLog:
        import logging

        import optuna

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handler = logging.FileHandler(self.path, encoding="utf-8")
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        self._handler.addFilter(_no_traceback_for_stops)
        optuna.logging.disable_default_handler()
        for name in ("optuna", "autotune"):
            logger = logging.getLogger(name)
            logger.addHandler(self._handler)
            logger.setLevel(min(logger.level or logging.INFO, logging.INFO))
        # autotune's own warnings (an engine reaped, a note not written) still reach the console, as they
        # would with no logging set up; its info lines and all of Optuna's stay in the file
        self._console = logging.StreamHandler(sys.stderr)
        self._console.setLevel(logging.WARNING)
        self._console.setFormatter(logging.Formatter("%(message)s"))
        logging.getLogger("autotune").addHandler(self._console)
        return self

    def __exit__(self, *exc: object) -> None:
        import logging

        import optuna

        if self._handler is not None:
            for name in ("optuna", "autotune"):
                logging.getLogger(name).removeHandler(self._handler)
            if self._console is not None:  # set with the handler
                logging.getLogger("autotune").removeHandler(self._console)
            self._handler.close()
        optuna.logging.enable_default_handler()

    def log(self, line: str) -> None:
        self.logger.info(line)


def _no_traceback_for_stops(record) -> bool:
    """A stop (Ctrl-C, a signal) is not a crash, nor is a failure autotune raised on purpose (it says what
    happened in its own one line): their records keep the message, not the traceback."""
    from autotune.errors import AutotuneError

    if record.exc_info and isinstance(record.exc_info[1], (KeyboardInterrupt, AutotuneError)):
        record.exc_info = None
    return True


def print_comparison(rows, remeasure: Remeasurement | None) -> None:
    t = Table(title="best config against the baselines")
    for col in ("config", "trial", "capacity req/s", "output tok/s", "p95 TTFT ms", "best's gain", "state"):
        t.add_column(col, justify="left" if col in ("config", "state") else "right")
    best = rows[0] if rows and rows[0].label.startswith("best") else None
    for r in rows:
        gain = "-"  # none over a row that held every load: its capacity is unknown
        if best is not None and r is not rows[0] and not r.at_least:
            by = "≥" if best.at_least else ""
            gain = f"{by}{(best.capacity_rps / r.capacity_rps - 1) * 100:+.0f}%" if r.capacity_rps > 0 else "from 0"
        t.add_row(
            r.label,
            str(r.trial),
            f"{'≥' if r.at_least else ''}{r.capacity_rps:.2f}",
            f"{r.output_tok_s:.1f}",
            "-" if r.ttft_p95_ms is None else f"{r.ttft_p95_ms:.0f}",
            gain,
            r.state,
        )
    out.print(t)
    if any(r.at_least for r in rows):
        out.print(
            "≥: every load the ladder offered held, so the capacity is at least this (a higher [objective] "
            "max_steps finds it); no gain is computed over it",
            markup=False,
            highlight=False,
        )
    if remeasure:
        m = Table(title="re-measured, interleaved (capacity req/s)")
        for col in ("candidate", "runs", "median", "spread"):
            m.add_column(col)
        for c in remeasure.candidates:
            steps = [[StepRecord.from_json(s) for s in run] for run in c.get("runs") or []]
            runs = [
                f"{'≥' if i < len(steps) and held_every_load(steps[i]) else ''}{x:.2f}"
                for i, x in enumerate(c["capacities"])
            ]
            m.add_row(c["label"], ", ".join(runs), f"{c['median']:.2f}", f"{c['spread']:.2f}")
        out.print(m)
        out.print(remeasure.sentence())


def print_pareto(front) -> None:
    """The Pareto front of output throughput against p95 TTFT: no single winner, the trade-off."""
    t = Table(title="Pareto front: output throughput against p95 TTFT (trials meeting the SLOs)")
    for col in ("trial", "output tok/s", "p95 TTFT ms", "config"):
        t.add_column(col, justify="left" if col == "config" else "right")
    for tr in sorted(front, key=lambda x: -x.values[0]):
        label = tr.baseline or ", ".join(f"{k}={v}" for k, v in tr.params.items())
        t.add_row(str(tr.number), f"{tr.values[0]:.1f}", f"{tr.values[1] * 1000:.0f}", label)
    out.print(t)
    if not front:
        out.print("no trial met every SLO: the front is empty")


def print_history(entries) -> None:
    """The publish history, newest last: what production ran, what each entry changed against the good
    config before it, and why. Names are never cut: the table is as wide as its content. Under it, the
    proposal that waits for approval: its values, its diff against the config production ran when its tuning
    measured it (a proposal from before the daemon recorded that: the last good entry's) and its gain."""
    import time

    good_before: dict[int, Entry | None] = {}
    last = None
    for e in entries:
        good_before[e.number] = last
        if e.outcome in ("adopted", "published"):
            last = e
    t = Table(title="publish history")
    for col in ("entry", "when", "outcome", "source", "changes", "reason"):
        t.add_column(col, no_wrap=col in ("entry", "when", "outcome", "source"))
    for e in entries:
        src = e.source.get("study", "") + (f" trial {e.source['trial']}" if "trial" in e.source else "")
        if "rollback_to" in e.source:
            src = f"rollback to {e.source['rollback_to']}"
        before = good_before[e.number]
        changes = (
            "as found"
            if e.outcome == "adopted" or before is None
            else (", ".join(config_diff(before.values, e.values)) or "none")
        )
        t.add_row(
            str(e.number), time.strftime("%Y-%m-%d %H:%M", time.localtime(e.time)), e.outcome, src, changes, e.reason
        )
    _print_whole(t)
    proposal = next((e for e in reversed(entries) if e.outcome == "proposed"), None)
    if proposal is not None:
        # against what production ran when the tuning measured it, else the last good entry
        against = proposal.source.get("production")
        if against is None:
            against = last.values if last is not None else None
        for line in proposal_lines(proposal, against):
            out.print(line, markup=False, highlight=False, crop=False, soft_wrap=True)


def _print_whole(table: Table) -> None:
    """A table at the width its content needs, wider than the terminal if it must: nothing cut."""
    from rich.measure import Measurement

    need = Measurement.get(out, out.options.update_width(100_000), table).maximum
    width = out.width
    if need <= width:
        out.print(table)
        return
    out.width = need  # rich prints no wider than its console: widen it for this table
    try:
        out.print(table, crop=False)
    finally:
        out.width = width


def _shown(v) -> str:
    return f"{v:.10g}" if isinstance(v, float) else str(v)


def config_diff(old: dict, new: dict) -> list[str]:
    """``key old -> new`` for each value that differs ("unset" where one side has none), in key order."""
    lines = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, float) or isinstance(b, float):
            same = a is not None and b is not None and _shown(a) == _shown(b)
        else:
            same = a == b
        if not same:
            lines.append(f"{k} {'unset' if k not in old else _shown(a)} -> {'unset' if k not in new else _shown(b)}")
    return lines


def proposal_lines(entry, production: dict | None) -> list[str]:
    """What an approver reads about a proposal: where it comes from, its gain, its values, its diff."""
    src = entry.source
    head = f"proposal: entry {entry.number}"
    if "study" in src:
        head += f", trial {src.get('trial')} of {src['study']}"
    if src.get("trigger"):
        head += f" (tuned because: {src['trigger']})"
    lines = [head]
    if src.get("why"):
        lines.append(f"  gain: {src['why']}")
    lines.append("  values: " + (" ".join(f"{k}={_shown(v)}" for k, v in entry.values.items()) or "none"))
    if production is None:
        lines.append("  against production: production's config is not known")
    else:
        diff = config_diff(production, entry.values)
        lines.append("  against production: " + ("; ".join(diff) if diff else "the same config"))
    lines.append("  decide: autotune publish --config FILE --approve | --reject")
    return lines
