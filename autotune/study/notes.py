"""The notes a person reads first in optuna-dashboard: one per study, one per finished trial.

optuna-dashboard shows a markdown "Note" above each study and each trial. ``trial_note`` and
``study_note`` are pure (a record in, markdown out); ``save_notes`` writes them into the study's
storage the way the dashboard stores its own: study system attrs ``dashboard:note_ver`` and
``dashboard:note_str:<i>`` (a trial's under ``dashboard:<trial_id>:``), the version bumped on
every change, so a note open in someone's browser is not overwritten silently (the dashboard
refuses a save whose version is not the next one).

``save_notes`` may run after every trial (an Optuna callback) and at the end of a study:

- it reads the stored notes once and writes only those whose text changed;
- a note holds what autotune writes, then ``KEEP`` (a rule and one line saying so), then
  whatever a person wrote below it in the dashboard: that part is kept on every rewrite
  (a note a person wrote before autotune's first one is kept whole, below the line);
- trials' user attrs (the raw data) are never touched;
- a dashboard problem (storage, a malformed record) is logged at warning on the ``autotune``
  logger, never raised into the study.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import optuna
from optuna.trial import TrialState

from autotune.measure.slo import LATENCY_METRICS
from autotune.study.outputs import NOT_RECOMMENDED
from autotune.study.records import Attr, StepRecord, StudyResult, TrialRecord

__all__ = ["trial_note", "study_note", "save_notes", "KEEP"]

_log = logging.getLogger("autotune")

KEEP = "\n---\n\n*autotune rewrites the note above this line after every trial; what you write below it is kept.*\n"
_FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


# -- markdown helpers -----------------------------------------------------------------------------


def _md(text: object) -> str:
    """Text set inline in markdown: what would start emphasis, a link, HTML or a table cell escaped."""
    return re.sub(r"([\\`*_\[\]<>|~])", r"\\\1", str(text))


def _code(text: object) -> str:
    """An inline code span that survives backticks and table pipes in the value."""
    s = str(text).replace("\n", " ").replace("|", "\\|")
    if "`" not in s:
        return f"`{s}`"
    return f"`` {s} ``"


def _fenced(text: str) -> str:
    fence = "`" * max(3, max((len(m) for m in re.findall(r"`+", text)), default=0) + 1)
    return f"{fence}text\n{text.rstrip()}\n{fence}"


def _rps(x: float) -> str:
    return f"{x:.2f} req/s"


def _gain(new: float, ref: float) -> str:
    return f"{(new / ref - 1) * 100:+.1f} %"


def _measured(v: dict[str, Any]) -> str:
    m = v.get("measured")
    if m is None:
        return "not measured"
    metric = str(v.get("key", "")).rpartition("_")[2]
    return f"{m * 1000:.0f} ms" if metric in LATENCY_METRICS else f"{m:.1f}"


def _verdicts(step: StepRecord) -> str:
    return ", ".join(f"{_code(v['slo'])} {_measured(v)} ({'holds' if v.get('holds') else 'misses'})" for v in step.slos)


# -- a trial ----------------------------------------------------------------------------------------


def _status(r: TrialRecord) -> str:
    if r.feasible:
        return "meets every SLO"
    if r.failure_class:
        return f"misses: {r.failure_class}"
    if r.state == TrialState.PRUNED:
        return "misses: stopped early by the pruner"
    if r.state == TrialState.COMPLETE:
        return "misses an SLO at every load"
    return "misses: failed before a result"


def _config(r: TrialRecord) -> list[str]:
    args = r.engine_args
    if not args.values and not args.env:
        return ["Config: the engine's defaults (no engine args)."]
    rows = ["| engine arg | value |", "|---|---|"]
    rows += [f"| {_code(k)} | {_code(v)} |" for k, v in args.values.items()]
    rows += [f"| env {_code(k)} | {_code(v)} |" for k, v in args.env.items()]
    return rows


def _raw_data(r: TrialRecord) -> list[str]:
    keys = [
        (Attr.STEPS, "every load step's metrics and SLO verdicts"),
        (Attr.ARGV, "the exact command line"),
        (Attr.FAILURE_EXCERPT, "the engine's log around the failure"),
    ]
    lines = ["Raw data, in this trial's user attrs:", ""]
    lines += [f"- {_code(k)}: {what}" for k, what in keys if r.attrs.get(k)]
    if not r.attrs.get(Attr.PRECHECK):
        lines.append("- artifacts: the engine's logs and every request")
    return lines


def trial_note(r: TrialRecord, reference: TrialRecord | None) -> str:
    """The markdown for one finished trial; ``reference`` is the baseline gains are measured against."""
    lines = [f"### {_md(r.label)}: {_status(r)}", "", f"Chosen because: {_md(r.chosen_because.rstrip('.'))}."]
    notes = r.attrs.get(Attr.BASELINE_NOTES) or []
    if notes:
        lines.append("")
        lines += [f"- *{_md(n)}*" for n in notes]
    lines.append("")
    if r.failure_class:
        lines.append(f"**Failed: {_md(r.failure_class)}**, proven by:")
        lines += ["", _fenced(r.failure or "(no line recorded)")]
    elif r.feasible:
        lines.append(
            f"**Capacity: {_rps(r.capacity_rps)}, {r.capacity_output_tok_s:.0f} output tok/s** "
            "(the highest load at which every SLO held)"
        )
        if reference is not None and reference.number == r.number:
            lines += ["", "This is the reference baseline: the other trials' gains are over it."]
        elif reference is not None and r.capacity_rps > 0 and reference.capacity_rps > 0:
            lines += [
                "",
                f"**{_gain(r.capacity_rps, reference.capacity_rps)}** over the baseline "
                f"{_md(reference.label)} ({_rps(reference.capacity_rps)}, trial {reference.number})",
            ]
        top = r.capacity_step
        if top and top.slos:
            lines += ["", f"At capacity: {_verdicts(top)}."]
    elif r.state == TrialState.PRUNED:
        lines.append(
            f"Stopped by the pruner after {len(r.steps)} load steps, at {_rps(r.capacity_rps)} so far "
            "(below the median of earlier trials at the same step)."
        )
    elif r.state == TrialState.COMPLETE:
        lines.append("**Capacity: 0 req/s**: no load met every SLO.")
        if r.steps:
            lowest = min(r.steps, key=lambda s: s.load)
            lines += ["", f"At the lowest load ({_rps(lowest.rate)}): {_verdicts(lowest)}."]
    else:
        lines.append("No result: the trial stopped before it measured anything (interrupted, or its worker died).")
    if r.predicted_capacity_rps is not None:
        p = r.predicted_capacity_rps
        measured = f" (measured: {r.capacity_rps / p * 100:.0f} % of it)" if p > 0 and r.feasible else ""
        lines += ["", f"Predicted capacity (simulator): {_rps(p)}{measured}."]
    lines += ["", *_config(r), "", *_raw_data(r)]
    return "\n".join(lines) + "\n"


# -- the study --------------------------------------------------------------------------------------


def _who(r: TrialRecord) -> str:
    return f"trial {r.number} ({_md(r.label)})"


def study_note(result: StudyResult, slos: list[str]) -> str:
    """The markdown for the study: its winner, the gain over the best baseline, the re-measurement verdict."""
    lines: list[str] = []
    base, win = result.best_baseline, result.winner
    if result.pareto:
        front = result.front
        if front:
            lines.append("### Pareto front: " + ", ".join(_who(r) for r in front))
            lines += [""] + [f"- {_who(r)}: " + ", ".join(f"{v:.4g}" for v in r.values) for r in front]
        else:
            lines.append("### No configuration met every SLO")
    elif win is None:
        lines.append("### No configuration met every SLO")
        lines += ["", "Every trial missed an SLO at every load it tried, or failed: see the trials' notes."]
    else:
        lines.append(f"### Winner: {_who(win)}, {_rps(win.capacity_rps)}, {win.capacity_output_tok_s:.0f} output tok/s")
        lines.append("")
        if base is None:
            lines.append("No baseline met every SLO: there is no gain to state.")
        elif base.number == win.number:
            lines.append(f"The best baseline, {_md(base.label)}, is the winner: no sampled config beat it.")
        else:
            lines.append(
                f"**{_gain(win.capacity_rps, base.capacity_rps)}** over the best baseline, "
                f"{_md(base.label)} ({_rps(base.capacity_rps)}, trial {base.number})."
            )
    v = result.remeasurement
    lines.append("")
    if v is None:
        lines.append("Re-measurement: none yet (it runs at the end of the study; a later trial makes it stale).")
    else:
        lines.append(f"Re-measured, interleaved: {_md(v.sentence())}.")
        if (leader := result.leader) is not None:
            lines.append(f"Not recommended: {_who(leader)}, kept beside the best files as {NOT_RECOMMENDED}.*.")
    if v is not None:
        lines += ["", "| config | capacity per run (req/s) | median |", "|---|---|---|"]
        lines += [
            f"| {_md(c['label'])} | {', '.join(f'{x:.2f}' for x in c['capacities'])} | {c['median']:.2f} |"
            for c in v.candidates
        ]
    counts = result.counts()
    lines += [
        "",
        f"Trials: {len(result.records)}"
        + (" (" + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + ")" if counts else "")
        + ".",
    ]
    lines += ["", "SLOs: " + (", ".join(_code(s) for s in slos) if slos else "none") + "."]
    return "\n".join(lines) + "\n"


# -- writing them -----------------------------------------------------------------------------------


def _merged(ours: str, stored: str) -> str:
    """Our text, then KEEP, then what a person wrote below KEEP (or all of a note autotune never wrote)."""
    theirs = stored.partition(KEEP)[2] if KEEP in stored else stored
    return ours + KEEP + theirs


def save_notes(study: optuna.Study, slos: list[str]) -> None:
    """Write the study's note and every finished trial's whose text changed; never raises."""
    try:
        _save_notes(study, slos)
    except Exception as e:  # noqa: BLE001 - the dashboard's notes never stop a study
        _log.warning(
            "dashboard notes of study %s not written: %s: %s", getattr(study, "study_name", "?"), type(e).__name__, e
        )


def _save_notes(study: optuna.Study, slos: list[str]) -> None:
    # optuna_dashboard's public save_note takes a live optuna.Trial only (building one for a finished
    # trial would run the sampler's before_trial); its storage functions take a trial id
    from optuna_dashboard._note import get_note_from_system_attrs, save_note_with_version

    storage, study_id = study._storage, study._study_id
    ids = {t.number: t._trial_id for t in study.get_trials(deepcopy=False)}
    result = StudyResult.of(study)
    reference = result.best_baseline
    wanted: list[tuple[int | None, str]] = [(None, study_note(result, slos))]
    for r in result.records:
        if r.state not in _FINISHED or Attr.ENGINE_ARGS not in r.attrs or r.number not in ids:
            continue
        try:
            wanted.append((ids[r.number], trial_note(r, reference)))
        except Exception as e:  # noqa: BLE001 - one malformed record: the others' notes are still written
            _log.warning("dashboard note of trial %d not written: %s: %s", r.number, type(e).__name__, e)
    stored = storage.get_study_system_attrs(study_id)
    for trial_id, text in wanted:
        old = get_note_from_system_attrs(stored, trial_id)
        body = _merged(text, old["body"])
        if body != old["body"]:
            save_note_with_version(storage, study_id, trial_id, int(old["version"]) + 1, body)
