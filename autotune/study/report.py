"""``autotune report``: one self-contained HTML page a person can open, from the study's storage alone."""

from __future__ import annotations

import html
from pathlib import Path

import optuna
from optuna.trial import TrialState

from autotune.study.definition import StudyDefinition
from autotune.study.records import TrialRecord, constraints_of

__all__ = ["write_report"]


def _ttft_vs_throughput(study: optuna.Study):
    import plotly.graph_objects as go

    fig = go.Figure()
    for feasible in (True, False):
        xs, ys, texts = [], [], []
        for t in map(TrialRecord.of, study.get_trials(deepcopy=False)):
            for s in t.steps:
                if s.get("ttft_p95") is None or s["passed"] is not feasible:
                    continue
                xs.append(s["output_throughput"])
                ys.append(s["ttft_p95"] * 1000)
                texts.append(f"trial {t.number} ({t.label}), {s['rate']:.2f} req/s")
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", text=texts, name="SLOs hold" if feasible else "SLOs miss",
                                 marker={"color": "seagreen" if feasible else "indianred"}))
    fig.update_layout(title="p95 TTFT against output throughput, every load step of every trial",
                      xaxis_title="output tokens/s", yaxis_title="p95 TTFT (ms)")
    return fig


def write_report(d: StudyDefinition, out: Path) -> Path:
    from optuna import visualization as vis

    study = optuna.load_study(study_name=d.name, storage=d.storage)
    figures, notes = [], []
    multi = len(study.directions) > 1
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if multi:
        figures.append(vis.plot_pareto_front(study, target_names=["output tok/s", "p95 TTFT (s)"],
                                             constraints_func=constraints_of))
    else:
        figures.append(vis.plot_optimization_history(study, target_name="capacity (req/s)"))
    figures.append(_ttft_vs_throughput(study))
    if len(done) >= 2:
        try:
            figures.append(vis.plot_param_importances(study, target=(lambda t: t.values[0]) if multi else None,
                                                      target_name="output tok/s" if multi else "capacity"))
        except (RuntimeError, ValueError) as e:  # too few distinct values: say so instead of a plot
            notes.append(f"parameter importances: not computable yet ({e})")
    else:
        notes.append("parameter importances: needs at least two completed trials")
    rows = []
    for t in map(TrialRecord.of, study.get_trials(deepcopy=False)):
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(x))}</td>" for x in (
            t.number, t.label, t.state.name.lower(), f"{t.capacity_rps:.2f}", "yes" if t.feasible else "no",
            t.failure_class or "", " ".join(f"{k}={v}" for k, v in t.params.items()))) + "</tr>")
    parts = [fig.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, fig in enumerate(figures)]
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>autotune: {html.escape(d.name)}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}} td,th{{border:1px solid #ccc;padding:4px 8px}}</style>
</head><body><h1>autotune study {html.escape(d.name)}</h1>
<p>{len(study.trials)} trials; SLOs: {html.escape(", ".join(s.text for s in d.slos))}; storage {html.escape(d.storage)}</p>
{"".join(parts)}
{"".join(f"<p><i>{html.escape(n)}</i></p>" for n in notes)}
<h2>Trials</h2><table><tr><th>#</th><th>config</th><th>state</th><th>capacity req/s</th><th>feasible</th><th>failure</th><th>params</th></tr>
{"".join(rows)}</table></body></html>"""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out
