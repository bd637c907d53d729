"""A finished trial in words: the line ``autotune study`` prints for it and the daemon's journal repeats.

Pure text from a ``TrialRecord`` (which config, why it ran, its capacity or why it has none), so the
console and the daemon, which may not know each other, say a trial the same way.
"""

from __future__ import annotations

from optuna.trial import TrialState

from autotune.measure.session import MIN_OFFERED_SHARE
from autotune.measure.slo import LATENCY_METRICS
from autotune.study.records import TrialRecord

__all__ = [
    "elapsed_text",
    "gain_text",
    "capacity_text",
    "client_bound_text",
    "same_trial",
    "stopped_text",
    "trial_line",
]


def elapsed_text(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def gain_text(r: TrialRecord, reference: TrialRecord | None) -> str:
    """``r``'s gain over ``reference``: none over a reference that held every load (its capacity is unknown), "at
    least" where ``r`` held every load."""
    if reference is None or reference.capacity_rps <= 0 or reference.capacity_at_least:
        return ""
    by = "at least " if r.capacity_at_least else ""
    return f", {by}{(r.capacity_rps / reference.capacity_rps - 1) * 100:+.0f}% vs {reference.label}"


def capacity_text(r: TrialRecord) -> str:
    """The capacity as measured, or the floor a ladder that never missed stopped at."""
    return f"{'at least ' if r.capacity_at_least else ''}{r.capacity_rps:.2f} req/s"


def _missed(r: TrialRecord) -> str:
    """How the lowest load missed: the SLOs that failed there, measured against target."""
    steps = sorted(r.steps, key=lambda s: s.load)
    if not steps:
        return "nothing measured"
    low = steps[0]
    misses = [v for v in low.slos if not v["holds"]]
    said = ", ".join(f"{v['slo']} measured {_measured(v)}" for v in misses) or f"{low.failed} failed requests"
    return f"no load met the SLOs (at {low.rate:.2f} req/s: {said})"


def _measured(v: dict) -> str:
    m = v.get("measured")
    if m is None:
        return "nothing"
    latency = v["key"].rpartition("_")[2] in LATENCY_METRICS  # p95_ttft, mean_tpot; rps is a rate
    return f"{m * 1000:.0f} ms" if latency else f"{m:.2f}"


def stopped_text(r: TrialRecord) -> str:
    """Why a trial states no capacity within the SLOs: its failure, its lost race, the pruner, or its lowest load's
    miss ("" for one that held the SLOs at some load)."""
    if r.failure_class:
        return f"{r.failure_class}: {r.failure}"
    if r.state == TrialState.PRUNED and r.race and r.race.lost:
        return (
            f"lost the race to trial {r.race.incumbent}: missed the SLOs at "
            f"{r.race.missed_at_rps or 0.0:.2f} req/s, where it holds them"
        )
    if r.state == TrialState.PRUNED:
        return f"stopped early at {r.capacity_rps:.2f} req/s (the pruner: no better than the median so far)"
    if r.state != TrialState.COMPLETE:
        return r.state.name.lower()
    return "" if r.feasible and r.capacity_rps > 0 else _missed(r)


def trial_line(r: TrialRecord, reference: TrialRecord | None) -> str:
    """One finished trial in our words: which config, why it ran, and its capacity or its failure."""
    config = " ".join(f"{k}={v}" for k, v in r.config.items()) or "(the space's defaults)"
    client_bound = client_bound_text(r)
    outcome = stopped_text(r)
    if not outcome:
        held = "; it held every load offered" if r.capacity_at_least and not client_bound else ""
        outcome = f"{capacity_text(r)} within the SLOs ({r.capacity_output_tok_s:.0f} output tok/s{held})" + (
            "" if same_trial(r, reference) else gain_text(r, reference)
        )
    outcome += client_bound
    if r.same_config_as is not None:
        outcome = f"the same config as trial {r.same_config_as}, not run again: {outcome}"
    took = f" [{elapsed_text(r.wall_s)}]" if r.wall_s else ""
    return f"trial {r.number} ({r.chosen_because}) {config} -> {outcome}{took}"


def client_bound_text(r: TrialRecord) -> str:
    """Where the load client, not the engine, set a step's outcome, and what to do; "" where it timed every step."""
    bound = [s for s in r.steps if not s.passed and not s.client_kept_up]
    if not bound:
        return ""
    s = min(bound, key=lambda s: s.rate)
    if s.client_lag_p99 is not None and s.offered_share >= MIN_OFFERED_SHARE:
        why = f"its own event loop ran {s.client_lag_p99 * 1000:.0f} ms late at p99"
    else:
        why = f"it sent the load {1 / max(s.offered_share, 1e-9):.2f}x slower than scheduled"
    return (
        f"; client-bound at {s.rate:.2f} req/s ({why}), so that miss bounds nothing: give the replay more "
        "processes ([objective] replay_workers) or run autotune where it has cores to spare"
    )


def same_trial(r: TrialRecord, other: TrialRecord | None) -> bool:
    return other is not None and other.number == r.number
