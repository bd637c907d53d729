"""What a person sees: tables and progress on the terminal (rich). Results go to stdout, chatter to stderr."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from autotune.measure.session import Outcome
from autotune.study.records import Remeasurement
from autotune.measure.metrics import Distribution

out = Console()
err = Console(stderr=True)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def print_result(result: Outcome) -> None:
    """A single-load session (bench, replay): engine start, throughput, latency, failed requests, SLOs."""
    if result.failure is not None:
        f = result.failure
        err.print(f"[bold red]engine failed: {f.failure_class.value}[/] - {f.summary}")
        if f.excerpt:
            err.print(f.excerpt, markup=False, highlight=False)
    step = result.last
    if step is None:
        return
    s = step.summary
    head = Table(title=f"{step.model} at {result.url}", show_header=False, box=None)
    rows = [
        ("requests", f"{s.completed} completed, {s.failed} failed of {s.requests}"),
        ("duration", f"{s.duration_s:.2f} s"),
        ("request throughput", f"{s.request_throughput:.2f} req/s"),
        ("output throughput", f"{s.output_throughput:.1f} tok/s"),
        ("total token throughput", f"{s.total_token_throughput:.1f} tok/s"),
        ("goodput", f"{s.goodput:.2f} req/s"),
        ("SLO attainment", "-" if s.slo_attainment != s.slo_attainment else f"{s.slo_attainment:.1%}"),
    ]
    if result.engine_ready_s is not None:
        rows.insert(0, ("engine start", f"{result.engine_ready_s:.1f} s"))
    for k, v in rows:
        head.add_row(k, v)
    out.print(head)
    lat = Table(title="latency (ms)")
    for col in ("metric", "mean", "p50", "p90", "p95", "p99", "n"):
        lat.add_column(col, justify="right" if col != "metric" else "left")
    dists: list[tuple[str, Distribution]] = [("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2E", s.e2e),
                                             ("send lag", s.send_lag)]
    for name, d in dists:
        lat.add_row(name, _ms(d.mean), _ms(d.p50), _ms(d.p90), _ms(d.p95), _ms(d.p99), str(d.count))
    out.print(lat)
    if s.errors:
        errs = Table(title="failed requests")
        errs.add_column("count", justify="right")
        errs.add_column("error")
        for text, n in sorted(s.errors.items(), key=lambda kv: -kv[1]):
            errs.add_row(str(n), text)
        out.print(errs)
    if step.verdicts:
        slo = Table(title="SLOs")
        for col in ("SLO", "measured", "verdict"):
            slo.add_column(col)
        for v in step.verdicts:
            if v.measured is None:
                shown = "-"
            elif v.slo.is_latency:
                shown = f"{v.measured * 1000:.1f} ms"
            else:
                shown = f"{v.measured:.2f}"
            slo.add_row(v.slo.text, shown, "[green]holds[/]" if v.holds else "[red]misses[/]")
        out.print(slo)


class StudyView:
    """The live view of a study: the current trial, its phase, the best so far.

    On a terminal a rich Live panel; elsewhere (CI, journald) one timestamped line per change.
    """

    def __init__(self, name: str, budget: int | None) -> None:
        from rich.live import Live

        self.name, self.budget = name, budget
        self.line, self.best = "", "no feasible trial yet"
        self._live = Live(console=err, transient=False, auto_refresh=False) if err.is_terminal else None

    def __enter__(self) -> StudyView:
        if self._live is not None:
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)

    def show(self, line: str) -> None:
        import time

        self.line = line
        if self._live is None:
            err.print(f"{time.strftime('%H:%M:%S')} {line}", markup=False, highlight=False)
            return
        from rich.panel import Panel

        budget = f" / {self.budget} trials" if self.budget else ""
        self._live.update(Panel(f"{line}\n[dim]best so far:[/] {self.best}", title=f"autotune study {self.name}{budget}"),
                          refresh=True)

    def set_best(self, text: str) -> None:
        self.best = text


def print_comparison(rows, remeasure: Remeasurement | None) -> None:
    t = Table(title="best config against the baselines")
    for col in ("config", "trial", "capacity req/s", "output tok/s", "p95 TTFT ms", "gain", "state"):
        t.add_column(col, justify="left" if col in ("config", "state") else "right")
    best = rows[0].capacity_rps if rows and rows[0].label.startswith("best") else None
    for r in rows:
        gain = "-"
        if best is not None and r is not rows[0]:
            gain = f"{(best / r.capacity_rps - 1) * 100:+.0f}%" if r.capacity_rps > 0 else "from 0"
        t.add_row(r.label, str(r.trial), f"{r.capacity_rps:.2f}", f"{r.output_tok_s:.1f}",
                  "-" if r.ttft_p95_ms is None else f"{r.ttft_p95_ms:.0f}", gain, r.state)
    out.print(t)
    if remeasure:
        m = Table(title="re-measured, interleaved (capacity req/s)")
        for col in ("candidate", "runs", "median", "spread"):
            m.add_column(col)
        for c in remeasure.candidates:
            m.add_row(c["label"], ", ".join(f"{x:.2f}" for x in c["capacities"]), f"{c['median']:.2f}", f"{c['spread']:.2f}")
        out.print(m)
        r = remeasure
        if r.winner == r.baseline:
            verdict = f"no gain: no searched config beat {r.baseline} on the median"
        elif r.significant:
            verdict = (f"{r.winner} beats {r.baseline} by {r.gain_rps:.2f} req/s, "
                       f"more than the spread ({r.noise_rps:.2f})")
        else:
            verdict = (f"no gain: {r.winner} and {r.baseline} differ by "
                       f"{r.gain_rps:.2f} req/s, within the spread ({r.noise_rps:.2f})")
        out.print(verdict)


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
    """The publish history, newest last: what production ran and why it changed."""
    import time

    t = Table(title="publish history")
    for col in ("entry", "when", "outcome", "source", "reason"):
        t.add_column(col)
    for e in entries:
        src = e.source.get("study", "") + (f" trial {e.source['trial']}" if "trial" in e.source else "")
        if "rollback_to" in e.source:
            src = f"rollback to {e.source['rollback_to']}"
        t.add_row(str(e.number), time.strftime("%Y-%m-%d %H:%M", time.localtime(e.time)), e.outcome, src, e.reason)
    out.print(t)
