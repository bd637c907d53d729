"""The daemon's state machine, kept in one JSON file so a restart resumes where it stopped.

    watching ──trigger──> tuning ──winner──> publishing ──> verifying ──> watching
        ^                   │  │                               │
        │                   │  └─approval──> awaiting_approval ┘ (a person: autotune publish --approve,
        │                   │                                     which the daemon publishes on its loop)
        └──no better config─┘                                  └──> rolling_back ──> watching

Every transition is written (atomically) before the work it announces starts, so after a
crash the daemon knows what it was doing: a tuning resumes its Optuna study; a publish that
was in flight is verified again or rolled back (publish.transaction.recover).

``decide`` is the trigger logic, pure: drift of the traffic fingerprint since the config was
tuned, a sustained SLO breach, a schedule, or a request by hand; a cooldown after every
tuning (hysteresis: a trigger that keeps firing does not restart tunings back to back) and
the allowed time windows gate them. A request by hand (``autotune retune``) skips the cooldown,
not the windows: it stays pending (its file stays) until the tuning it asks for starts.

What starts the cooldown is a tuning that reached a verdict (``last_tuning_end``), whatever the
verdict: a config published, one proposed, or nothing published because nothing beat production
by more than the noise, no config met the SLOs, or production's config changed while it ran. Those
measured production's traffic and said something about it; the cooldown after them is the
hysteresis, and the journal line of the verdict says that triggers now wait it out. A tuning that
reached no verdict (its child failed or was interrupted, or no trial measured anything: every
config failed to start) tuned nothing: it leaves ``last_tuning_end`` and the tuned fingerprint as
they were (no cooldown, the schedule still counts from the last real tuning), and its trigger is
tried again after a backoff (``retry_at``; the daemon doubles it with each such tuning in a row,
``empty_tunings``, up to the cooldown), so a broken staging never loops tunings back to back.
"""

from __future__ import annotations

import enum
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from autotune.errors import IllegalTransition
from autotune.locations import atomic_write

__all__ = ["Phase", "DaemonState", "StateStore", "decide", "duration_text", "IllegalTransition"]


class Phase(str, enum.Enum):
    WATCHING = "watching"
    TUNING = "tuning"
    AWAITING_APPROVAL = "awaiting_approval"
    PUBLISHING = "publishing"
    VERIFYING = "verifying"
    ROLLING_BACK = "rolling_back"


ALLOWED: dict[Phase, set[Phase]] = {
    Phase.WATCHING: {Phase.TUNING, Phase.AWAITING_APPROVAL},  # the latter: an approved publish a restart cut short
    Phase.TUNING: {Phase.WATCHING, Phase.PUBLISHING, Phase.AWAITING_APPROVAL},
    Phase.AWAITING_APPROVAL: {Phase.WATCHING, Phase.PUBLISHING},
    Phase.PUBLISHING: {Phase.VERIFYING, Phase.ROLLING_BACK, Phase.WATCHING},
    Phase.VERIFYING: {Phase.WATCHING, Phase.ROLLING_BACK},
    Phase.ROLLING_BACK: {Phase.WATCHING},
}


@dataclass(frozen=True)
class DaemonState:
    phase: Phase = Phase.WATCHING
    since: float = 0.0
    tuned_fingerprint: dict[str, Any] | None = None  # the traffic the production config was tuned for
    last_tuning_end: float = 0.0  # wall clock; 0 = never
    breach_streak: int = 0  # consecutive windows with an SLO missed
    trigger: str | None = None  # why the current (or last) tuning started
    study_name: str | None = None  # the tuning's Optuna study (resumed after a restart)
    study_file: str | None = None
    tunings: int = 0
    tunings_by_trigger: dict[str, int] = field(default_factory=dict)  # started tunings by trigger kind (the metric)
    tuning_started: float = 0.0  # wall clock when the current (or last) tuning started
    production_values: dict[str, Any] | None = None  # production's config when the tuning started: its baseline
    imitated: dict[str, Any] | None = None  # the fingerprint the current (or last) tuning's traffic imitates
    note: str = ""  # the last thing worth telling (systemd STATUS=, autotune status)
    scrape_error: str | None = None  # the last failed scrape of production, "URL: error" (kept once it works again)
    scrape_error_at: float = 0.0  # wall clock of it
    scrape_failing: bool = False  # production's metrics do not answer now
    empty_tunings: int = 0  # tunings in a row that reached no verdict (see the module's docstring)
    retry_at: float = 0.0  # wall clock: no trigger (but a request by hand) starts a tuning before it
    trials_told: tuple[int, ...] = ()  # the running tuning's finished trials the journal has a line for
    last_decision: str = ""  # the note of the last decision (a verdict, a publish or proposal, its outcome)
    last_decision_at: float = 0.0  # wall clock of it

    def to(self, phase: Phase, **changes: Any) -> DaemonState:
        if phase is not self.phase and phase not in ALLOWED[self.phase]:
            raise IllegalTransition(f"daemon cannot go from {self.phase.value} to {phase.value}")
        return replace(self, phase=phase, since=time.time(), **changes)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["phase"] = self.phase.value
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DaemonState:
        return cls(**{**d, "phase": Phase(d["phase"]), "trials_told": tuple(d.get("trials_told", ()))})


class StateStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.path = self.root / "state.json"
        self.retune_flag = self.root / "retune-requested"
        self.approval_flag = self.root / "publish-approved"
        self.rollback_flag = self.root / "rollback-requested"

    def load(self) -> DaemonState:
        if not self.path.is_file():
            return DaemonState(since=time.time())
        return DaemonState.from_json(json.loads(self.path.read_text()))

    def save(self, state: DaemonState) -> DaemonState:
        atomic_write(self.path, json.dumps(state.to_json(), indent=1) + "\n")
        return state

    def request_retune(self, reason: str = "by hand") -> None:
        """``autotune retune``: a file the daemon picks up on its next tick (no socket to secure)."""
        atomic_write(self.retune_flag, reason + "\n")

    def retune_request(self) -> str | None:
        """The pending request's reason (None: none); it stays pending until ``clear_retune_request``."""
        try:
            return self.retune_flag.read_text(encoding="utf-8", errors="replace").strip() or "by hand"
        except FileNotFoundError:
            return None

    def clear_retune_request(self) -> None:
        self.retune_flag.unlink(missing_ok=True)

    def approve(self, entry: int) -> None:
        """``autotune publish --approve``: the proposal (history entry ``entry``) the daemon publishes on its loop."""
        atomic_write(self.approval_flag, f"{entry}\n")

    def approval(self) -> int | None:
        """The history entry a person approved and the daemon has not taken yet (None: none)."""
        try:
            return int(self.approval_flag.read_text(encoding="utf-8", errors="replace").strip())
        except FileNotFoundError:
            return None
        except ValueError:  # not written by `autotune publish`: no approval
            return None

    def clear_approval(self) -> None:
        self.approval_flag.unlink(missing_ok=True)

    def request_rollback(self, to: int) -> None:
        """``autotune rollback`` while a tuning holds the GPUs the rollback needs (blue/green): the daemon
        pauses the tuning, rolls back to entry ``to`` on its loop, and resumes the tuning."""
        atomic_write(self.rollback_flag, f"{to}\n")

    def rollback_request(self) -> int | None:
        try:
            return int(self.rollback_flag.read_text(encoding="utf-8", errors="replace").strip())
        except (FileNotFoundError, ValueError):
            return None

    def clear_rollback_request(self) -> None:
        self.rollback_flag.unlink(missing_ok=True)

    def take_retune_request(self) -> str | None:
        reason = self.retune_request()
        self.clear_retune_request()
        return reason


@dataclass(frozen=True)
class Observation:
    """What one watcher window said, reduced to what the triggers need."""

    drift: float | None  # fingerprint distance from the tuned one; None when unknown
    breach: bool | None  # an SLO certainly missed in this window; None when the window said nothing
    saturated: bool = False  # requests queued through the window (a breach too): production is at capacity


@dataclass(frozen=True)
class Decision:
    trigger: str | None  # why to tune now; None: keep watching
    breach_streak: int
    waiting: str = ""  # a trigger that fired but is held (cooldown, outside the windows)


def decide(
    state: DaemonState,
    obs: Observation | None,
    *,
    now: float,
    drift_threshold: float,
    breach_windows: int,
    every_s: float,
    cooldown_s: float,
    in_window: bool,
    manual: str | None = None,
    windows: str = "",
) -> Decision:
    """Whether a watching daemon starts a tuning now (pure: the tests drive it with made-up windows).

    ``windows`` names the tuning windows in the note of a trigger held outside them."""
    streak = state.breach_streak
    if obs is not None and obs.breach is not None:
        streak = streak + 1 if obs.breach else 0
    reason = None
    if manual:
        reason = f"requested: {manual}"
    elif obs is not None and obs.drift is not None and obs.drift > drift_threshold:
        if f"{obs.drift:.2f}" == f"{drift_threshold:.2f}":  # never "0.50 > 0.50"
            reason = f"traffic drift {obs.drift:.3f} reached the threshold ({drift_threshold:.2f})"
        else:
            reason = f"traffic drift {obs.drift:.2f} > {drift_threshold:.2f}"
    elif streak >= breach_windows > 0:
        reason = (
            f"production saturated: requests queued through {streak} windows in a row"
            if obs is not None and obs.saturated
            else f"SLO missed in {streak} windows in a row"
        )
    elif every_s > 0 and state.last_tuning_end and now - state.last_tuning_end >= every_s:
        reason = f"scheduled: {(now - state.last_tuning_end) / 86400:.1f} days since the last tuning"
    if reason is None:
        return Decision(None, streak)
    if not manual and state.last_tuning_end and now - state.last_tuning_end < cooldown_s:
        left = cooldown_s - (now - state.last_tuning_end)
        return Decision(None, streak, waiting=f"{reason}; held by the cooldown for {duration_text(left)} more")
    if not manual and state.retry_at and now < state.retry_at:
        left = state.retry_at - now
        return Decision(
            None, streak, waiting=f"{reason}; the last tuning reached no verdict, tried again in {duration_text(left)}"
        )
    if not in_window:
        return Decision(
            None, streak, waiting=f"{reason}; held until a tuning window opens" + (f" ({windows})" if windows else "")
        )
    return Decision(reason, 0)


def duration_text(seconds: float) -> str:
    """A wait in words a person reads: "40 s", "12 min", "5 h 30 min" (never "0 min")."""
    s = max(round(seconds), 0)
    if s < 90:
        return f"{s} s"
    if s < 5400:
        return f"{round(s / 60)} min"
    h, m = divmod(round(s / 60), 60)
    return f"{h} h {m} min" if m else f"{h} h"
