"""One measured (or predicted) session as the tables ``autotune bench`` prints: throughput, latency
percentiles, failed requests, SLO verdicts. Here, below both console.py and the simulator, so that
``autotune bench`` and ``vllm-sim predict`` print the same rows from one place."""

from __future__ import annotations

from rich.table import Table

from autotune.measure.metrics import Distribution
from autotune.measure.session import Outcome

__all__ = ["outcome_tables"]


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def outcome_tables(out: Outcome, engine_start: str | None) -> list[Table]:
    """The last step's tables (none without a step); ``engine_start`` is the first row's text, if any."""
    step = out.last
    if step is None:
        return []
    s = step.summary
    head = Table(title=f"{step.model} at {out.url}", show_header=False, box=None)
    rows = [
        ("requests", f"{s.completed} completed, {s.failed} failed of {s.requests}"),
        ("duration", f"{s.duration_s:.2f} s"),
        ("request throughput", f"{s.request_throughput:.2f} req/s"),
        ("output throughput", f"{s.output_throughput:.1f} tok/s"),
        ("total token throughput", f"{s.total_token_throughput:.1f} tok/s"),
        ("goodput", f"{s.goodput:.2f} req/s"),
        ("SLO attainment", "-" if s.slo_attainment != s.slo_attainment else f"{s.slo_attainment:.1%}"),
    ]
    if step.client_lag_p99 is not None:
        processes = f"{step.workers} process{'es' if step.workers > 1 else ''}"
        client = f"{processes}, its own lag p99 {_ms(step.client_lag_p99)} ms"
        if step.client_bound:
            client += (
                f" [red]client-bound[/]: over {_ms(step.client_lag_bound)} ms, so the latencies below are partly the "
                "client's; give it more processes (--workers N) or run it on a host with cores to spare"
            )
        rows.append(("load client", client))
    if engine_start is not None:
        rows.insert(0, ("engine start", engine_start))
    for label, text in rows:
        head.add_row(label, text)
    tables = [head]
    lat = Table(title="latency (ms)")
    if s.itl_same_read >= 0.1:  # a 0.0 ms median without a word puzzles a reader
        lat.caption = (
            f"ITL: the gap between streamed events, as vllm bench serve measures it; {s.itl_same_read:.0%} "
            "of gaps are under 0.1 ms: events that arrived together in one read (the server sent several "
            "at once, e.g. --stream-interval); TPOT is per token"
        )
    for col in ("metric", "mean", "p50", "p90", "p95", "p99", "n"):
        lat.add_column(col, justify="right" if col != "metric" else "left")
    dists: list[tuple[str, Distribution]] = [
        ("TTFT", s.ttft),
        ("TPOT", s.tpot),
        ("ITL", s.itl),
        ("E2E", s.e2e),
        ("send lag", s.send_lag),
    ]
    for name, d in dists:
        lat.add_row(name, _ms(d.mean), _ms(d.p50), _ms(d.p90), _ms(d.p95), _ms(d.p99), str(d.count))
    tables.append(lat)
    if s.errors:
        errs = Table(title="failed requests")
        errs.add_column("count", justify="right")
        errs.add_column("error")
        for text, n in sorted(s.errors.items(), key=lambda kv: -kv[1]):
            errs.add_row(str(n), text)
        tables.append(errs)
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
        tables.append(slo)
    return tables
