"""``autotune report``: one self-contained HTML page, from the study's storage alone, that answers first.

Top to bottom, in the order a reader asks:

    #verdict      who won, by how much over which baseline, and whether the re-measurement says the gain
                  is real; the winner's config file, command line and SLO verdicts at its capacity
    #ladders      every trial's load steps: p95 TTFT and TPOT against load, the SLO targets drawn in
    #failures     failed trials grouped by class, each with the line that proves it
    #predictions  the simulator's predicted capacity against the measured one
    #importance   Optuna's parameter importances, once there are enough trials for them to mean something
    #history      Optuna's optimization history (or Pareto front) and every trial

The page opens offline: plotly's JS is inlined once in the head; no CDN, stylesheet or font is fetched.
Everything read from the study (labels, values, failure lines: the engine's own words) is html-escaped.
"""

from __future__ import annotations

import html
import re
import shlex
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from autotune.engine.secrets import redact
from autotune.measure.slo import LATENCY_METRICS
from autotune.study.definition import StudyDefinition
from autotune.study.lines import capacity_text, stopped_text
from autotune.study.records import Attr, StudyResult, TrialRecord, constraints_of

__all__ = ["write_report", "MIN_IMPORTANCE_TRIALS"]

# fANOVA over a handful of points ranks noise; baselines are not counted: they are hand-picked, not a
# spread over the space
MIN_IMPORTANCE_TRIALS = 10

_e = html.escape
_STYLE = """body{font-family:sans-serif;margin:2em;max-width:80em} table{border-collapse:collapse;margin:.5em 0}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left} pre{background:#f4f4f4;padding:.6em;overflow-x:auto}
#verdict .answer{font-size:1.2em} .holds{color:#1a7f37} .misses{color:#b3261e}"""


def _table(head: Sequence[str], rows: Iterable[Sequence[Any]], id_: str = "") -> str:
    ident = f' id="{id_}"' if id_ else ""
    return (
        f"<table{ident}><tr>"
        + "".join(f"<th>{_e(h)}</th>" for h in head)
        + "</tr>"
        + "".join("<tr>" + "".join(f"<td>{_e(str(c))}</td>" for c in r) + "</tr>" for r in rows)
        + "</table>"
    )


def _pct(new: float, old: float) -> str:
    return f"{(new / old - 1) * 100:+.0f} %" if old > 0 else "from 0"


def _config(t: TrialRecord) -> str:
    """What a trial ran, in a few words: its baseline's name, else its searched values."""
    if t.baseline:
        return f"baseline {t.baseline}"
    return " ".join(f"{k}={v}" for k, v in t.params.items()) or "no searched values"


def _shown(key: str, x: float | None) -> str:
    """A measured or target value of the SLO ``key`` (p95_ttft, throughput, ...), in its unit."""
    if x is None:
        return "nothing measured"
    if key.rsplit("_", 1)[-1] in LATENCY_METRICS:  # stored in seconds
        return f"{x * 1000:.0f} ms"
    return f"{x:.1f} tok/s" if key == "throughput" else f"{x:.2f} req/s"


# -- the verdict -----------------------------------------------------------------------------


def verdict_line(result: StudyResult) -> str:
    """The page's first sentence: the answer, and how far to trust it."""
    if result.pareto:
        front = sorted(result.front, key=lambda t: -t.values[0])
        if not front:
            return "No configuration met every SLO: the Pareto front is empty."
        return (
            f"A trade-off, not a winner: {len(front)} configuration(s) meet every SLO and none beats another on "
            "both output throughput and p95 TTFT: "
            + "; ".join(
                f"trial {t.number} ({_config(t)}) {t.values[0]:.0f} tok/s at {t.values[1] * 1000:.0f} ms" for t in front
            )
            + "."
        )
    w = result.winner
    if w is None:
        return _no_winner(result)
    r = result.remeasurement
    if r is not None:  # the medians of the interleaved runs: the numbers the verdict itself compares
        win, base = r.candidate(w.number) or r.candidates[-1], r.candidates[-1]
        n = len(win["capacities"])
        head = (
            f"Winner: trial {w.number} ({_config(w)}): {'at least ' if win.get('at_least') else ''}"
            f"{win['median']:.2f} req/s within the SLOs (posterior median, {n} re-measured run{'s' if n != 1 else ''})"
        )
        if win is not base and not base.get("at_least"):  # a gain over a floor is unknown
            head += f", {_pct(win['median'], base['median'])} over {base['label']} ({base['median']:.2f} req/s)"
        return head + f"; re-measured, interleaved: {r.sentence()}."
    head = f"Winner: trial {w.number} ({_config(w)}): {capacity_text(w)} within the SLOs"
    b = result.best_baseline
    if b is None:
        return head + "; no baseline met the SLOs, so there is no gain to state (single measurements, not re-measured)."
    if b.number == w.number:
        return head + "; no searched configuration beat it (single measurements, not re-measured)."
    if b.capacity_at_least:
        return head + (
            f"; {b.baseline} held every load it was offered ({capacity_text(b)}), so no gain over it "
            "can be stated (single measurements, not re-measured)."
        )
    return head + (
        f", {_pct(w.capacity_rps, b.capacity_rps)} over {b.baseline} ({b.capacity_rps:.2f} req/s); "
        "from single measurements, not re-measured: the gain is unverified."
    )


def _no_winner(result: StudyResult) -> str:
    measured = [t for t in result.records if t.state == TrialState.COMPLETE and t.steps]
    if not measured:
        failed = sum(1 for t in result.records if t.failure_class)
        return (
            f"No configuration met every SLO: no trial measured anything ({failed} of {len(result.records)} "
            "failed; see the failures below)."
        )
    close = min(measured, key=lambda t: max(t.constraints))  # the smallest worst miss
    step = min(close.steps, key=lambda s: s.load)  # its judged step: the lowest load tried
    missed = [v for v in step.slos if not v["holds"]]
    why = ", ".join(f"{v['slo']} (measured {_shown(v['key'], v['measured'])})" for v in missed) or (
        f"{step.failed} failed requests" if step.failed else "the client could not offer the load"
    )
    return (
        f"No configuration met every SLO: the closest, trial {close.number} ({_config(close)}), missed {why} "
        f"at its lowest load, {step.rate:.2f} req/s."
    )


def _verdict(d: StudyDefinition, result: StudyResult) -> str:
    parts = [f'<p class="answer" id="verdict-line"><strong>{_e(verdict_line(result))}</strong></p>']
    w = result.winner if not result.pareto else None
    if w is None:
        return "".join(parts)
    rows = []
    for b in result.baselines():
        if b.feasible and b.capacity_at_least:  # its capacity is unknown: no gain over it
            rows.append((b.baseline, b.number, f"≥{b.capacity_rps:.2f}", "-"))
        elif b.feasible and b.capacity_rps > 0:
            rows.append((b.baseline, b.number, f"{b.capacity_rps:.2f}", _pct(w.capacity_rps, b.capacity_rps)))
        else:
            rows.append((b.baseline, b.number, b.failure_class or "met no SLO", "-"))
    parts.append(
        "<h3>Gain over each baseline (single measurements)</h3>"
        + _table(("baseline", "trial", "capacity req/s", f"trial {w.number}'s gain"), rows, "gains")
    )
    r = result.remeasurement
    if r is not None:
        parts.append(
            "<h3>Re-measured, interleaved (capacity req/s)</h3>"
            + _table(
                ("candidate", "runs", "median", "spread"),
                [
                    (
                        c["label"],
                        ", ".join(f"{x:.2f}" for x in c["capacities"]),
                        f"{c['median']:.2f}",
                        f"{c['spread']:.2f}",
                    )
                    for c in r.candidates
                ],
                "remeasured",
            )
        )
    parts.append(_winner_files(d, w, result.capacity_of(w)[0]))
    top = w.capacity_step
    if top is not None:
        parts.append(
            f"<h3>SLOs at the highest load trial {w.number} held, {top.rate:.2f} req/s</h3>"
            + _table(
                ("SLO", "measured", "target", "verdict"),
                [
                    (
                        v["slo"],
                        _shown(v["key"], v["measured"]),
                        _shown(v["key"], v["target"]),
                        "holds" if v["holds"] else "misses",
                    )
                    for v in top.slos
                ],
                "winner-slos",
            )
        )
    return "".join(parts)


def _winner_files(d: StudyDefinition, w: TrialRecord, capacity: float) -> str:
    """The winner as `autotune study` writes it (outputs.write_best), rendered here instead of written, with its
    capacity as the study states it (StudyResult.capacity_of)."""
    kind = d.command.engine_kind
    env = redact(w.engine_args.env, d.secret_env) if Attr.ENGINE_ARGS in w.attrs else {}
    out = []
    if kind.config_file is not None and Attr.ENGINE_ARGS in w.attrs:
        header = [
            f"autotune: best config of trial {w.number}, capacity {capacity:.2f} req/s",
            f"run: {kind.config_usage} {kind.config_file}",
        ]
        if env:
            header.append("with environment: " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()))
        text = kind.render_config(d.command.model, kind.production_values(w.engine_args.values), header)
        out.append(f'<h3>{_e(kind.config_file)}</h3><pre id="winner-config">{_e(text)}</pre>')
    prefix = "env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " if env else ""
    out.append(f'<h3>Command line, as measured</h3><pre id="winner-command">{_e(prefix + shlex.join(w.argv))}</pre>')
    return "".join(out)


# -- the figures and tables below it -----------------------------------------------------------


def _ladders(d: StudyDefinition, result: StudyResult):
    import plotly.colors
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    measured = [t for t in result.records if t.steps]
    if not measured:
        return None
    fig = make_subplots(rows=1, cols=2, subplot_titles=("p95 TTFT (ms)", "p95 TPOT (ms)"))
    palette = plotly.colors.qualitative.Plotly
    for i, t in enumerate(measured):
        steps = sorted(t.steps, key=lambda s: s.load)  # the ladder bisects: in load order, not run order
        for col, p95 in ((1, lambda s: s.ttft_p95), (2, lambda s: s.tpot_p95)):
            fig.add_trace(
                go.Scatter(
                    x=[s.rate for s in steps],
                    y=[None if p95(s) is None else p95(s) * 1000 for s in steps],
                    mode="lines+markers",
                    name=f"trial {t.number} ({t.label})",
                    legendgroup=str(t.number),
                    showlegend=col == 1,
                    line={"color": palette[i % len(palette)]},
                    marker={"size": 10, "symbol": ["circle" if s.passed else "x" for s in steps]},
                    text=["passed" if s.passed else "missed" for s in steps],
                    hovertemplate="%{x:.2f} req/s: %{y:.0f} ms, %{text}",
                ),
                row=1,
                col=col,
            )
    for slo in d.slos:  # only the targets these two panels can show
        panel = {"ttft": 1, "tpot": 2}.get(slo.metric)
        if panel is not None and slo.is_latency:
            fig.add_hline(
                y=slo.target * 1000,
                line_dash="dash",
                line_color="firebrick",
                annotation_text=slo.text,
                row=1,
                col=panel,
            )
    fig.update_xaxes(title_text="load (req/s)")
    fig.update_layout(title="Capacity ladder of each trial (circle: the step met every SLO; x: it missed)", height=480)
    return fig


def _failures(result: StudyResult) -> str:
    groups: dict[str, list[TrialRecord]] = {}
    for t in result.records:
        if t.failure_class:  # a pre-check's oom never launched: apart from the engine's own
            cls = f"{t.failure_class} (pre-check, never launched)" if t.attrs.get(Attr.PRECHECK) else t.failure_class
            groups.setdefault(cls, []).append(t)
    if not groups:
        return "<p>No trial failed.</p>"
    out = []
    for cls, ts in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        out.append(f'<h3 class="failure-class">{_e(cls)}: {len(ts)} trial(s)</h3><ul>')
        for t in ts:
            excerpt = str(t.attrs.get(Attr.FAILURE_EXCERPT) or "")
            more = f"<details><summary>log excerpt</summary><pre>{_e(excerpt)}</pre></details>" if excerpt else ""
            out.append(f"<li>trial {t.number} ({_e(_config(t))}): <code>{_e(t.failure)}</code>{more}</li>")
        out.append("</ul>")
    return "".join(out)


def _predictions(result: StudyResult) -> str:
    rows = [
        (t.number, _config(t), f"{p:.2f}", f"{t.capacity_rps:.2f}", _pct(t.capacity_rps, p))
        for t in result.records
        if (p := t.predicted_capacity_rps) is not None
    ]
    if not rows:
        return "<p>This study made no predictions.</p>"
    return _table(("trial", "config", "predicted req/s", "measured req/s", "measured against predicted"), rows)


def _importance(study: optuna.Study, result: StudyResult):
    """(a note, or None; a figure, or None)."""
    from optuna import visualization as vis

    n = sum(1 for t in result.records if t.state == TrialState.COMPLETE and not t.baseline)
    if n < MIN_IMPORTANCE_TRIALS:
        return (
            f"Parameter importance needs at least {MIN_IMPORTANCE_TRIALS} completed trials (baselines not "
            f"counted); this study has {n}."
        ), None
    try:
        return None, vis.plot_param_importances(
            study,
            target=(lambda t: t.values[0]) if result.pareto else None,
            target_name="output tok/s" if result.pareto else "capacity",
        )
    except (RuntimeError, ValueError) as e:  # e.g. every trial has the same values: say so instead
        return f"Parameter importance is not computable for this study: {e}", None


def _history(study: optuna.Study, result: StudyResult):
    from optuna import visualization as vis

    if result.pareto:
        # constraints_func is deprecated (Optuna 5) for trial.set_constraint; the runner stores them the old
        # way on purpose (runner.make_sampler), so this is how the plot finds them
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return vis.plot_pareto_front(
                study, target_names=["output tok/s", "p95 TTFT (s)"], constraints_func=constraints_of
            )
    return vis.plot_optimization_history(study, target_name="capacity (req/s)")


def _trials(result: StudyResult) -> str:
    return _table(
        ("#", "config", "why chosen", "state", "capacity req/s", "feasible", "why it has none", "params", "wall s"),
        [
            (
                t.number,
                t.label,
                t.chosen_because,
                t.state.name.lower(),
                f"{t.capacity_rps:.2f}",
                "yes" if t.feasible else "no",
                stopped_text(t),
                " ".join(f"{k}={v}" for k, v in t.params.items()),
                f"{t.wall_s:.0f}",
            )
            for t in result.records
        ],
        "trials",
    )


def write_report(d: StudyDefinition, out: Path) -> Path:
    from plotly.offline import get_plotlyjs

    study = optuna.load_study(study_name=d.name, storage=d.storage)
    result = StudyResult.of(study)

    def fig_html(fig, div_id: str) -> str:  # the library is in the head once: no figure carries its own
        return "" if fig is None else fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id)

    note, importance = _importance(study, result)
    counts = ", ".join(f"{n} {state}" for state, n in sorted(result.counts().items()))
    storage = re.sub(r"(//[^/:@]*:)[^/]*@", r"\1***@", d.storage)  # a database URL's password stays out
    ladders = fig_html(_ladders(d, result), "ladder-plot") or "<p>No trial measured a load step.</p>"
    importance = f"<p>{_e(note)}</p>" if note else fig_html(importance, "importance-plot")
    sections = [
        ("verdict", "", _verdict(d, result)),  # the answer is the first line under the title
        ("ladders", "Capacity ladders", ladders),
        ("failures", "Failures, by class", _failures(result)),
        ("predictions", "Predicted against measured capacity", _predictions(result)),
        ("importance", "Parameter importance", importance),
        (
            "history",
            "Optimization history and every trial",
            fig_html(_history(study, result), "history-plot") + _trials(result),
        ),
    ]
    body = "\n".join(
        f'<section id="{sid}">' + (f"<h2>{title}</h2>" if title else "") + content + "</section>"
        for sid, title, content in sections
    )
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>autotune: {_e(d.name)}</title>
<style>{_STYLE}</style><script type="text/javascript">{get_plotlyjs()}</script></head><body>
<h1>autotune study {_e(d.name)}</h1>
{body}
<p><small>{len(result.records)} trials ({_e(counts)}); SLOs: {_e(", ".join(s.text for s in d.slos) or "none")};
storage {_e(storage)}</small></p>
</body></html>"""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out
