"""Publishing as a transaction: production ends on the new config verified, or on the last good one.

    record pending -> deploy (validate, write atomically, restart, wait for health)
                   -> canary (a short replay against the SLOs)
                   -> published                                     all passed
                   -> deploy the last good config -> rolled-back    anything failed

A target is anything target.Target describes: a vLLM YAML config with a restart command
(vllm_config.py) or an Xinference model (xinference.py). The
canary is a callable so the daemon can build it from production's own traffic and a person
running ``autotune publish`` from the study's workload.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.errors import AutotuneError, ConfigError
from autotune.publish.history import Entry, History
from autotune.publish.target import Target, wait_healthy

__all__ = ["CanaryResult", "PublishResult", "publish", "rollback", "rollback_choice", "recover", "adopt",
           "PublishLock", "tidy", "same_config"]


@dataclass(frozen=True)
class CanaryResult:
    passed: bool
    summary: dict[str, Any]  # the replay's metrics and SLO verdicts, as stored in the history

    @property
    def reason(self) -> str:
        failed = [v for v in self.summary.get("slos", []) if not v.get("holds")]
        if failed:
            return "canary missed " + ", ".join(f"{v['slo']} (measured {v.get('measured')})" for v in failed)
        return "canary failed: " + str(self.summary.get("error", "requests failed"))


Canary = Callable[[str], CanaryResult]  # production's URL -> verdict


@dataclass(frozen=True)
class PublishResult:
    entry: Entry
    ok: bool

    @property
    def outcome(self) -> str:
        return self.entry.outcome


def tidy(values: Mapping[str, Any]) -> dict[str, Any]:
    """Values as a person would write them: floats rounded to 10 significant digits (a sampler's
    0.8600000000000001 is 0.86), whatever they came from, before they are recorded or deployed."""
    return {k: float(f"{v:.10g}") if isinstance(v, float) else v for k, v in values.items()}


def same_config(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> bool:
    """The same engine args, floats compared as ``tidy`` writes them."""
    return a is not None and b is not None and tidy(a) == tidy(b)


def adopt(target: Target, history: History) -> Entry | None:
    """Record what production runs now as the first good config, so a rollback has somewhere to go."""
    if history.last_good() is not None:
        return None
    values = target.deployed()
    if values is None:
        return None
    return history.add("adopted", values, source={"target": target.name})


def publish(target: Target, values: Mapping[str, Any], history: History, canary: Canary,
            source: Mapping[str, Any] | None = None, entry: Entry | None = None,
            on_phase: Callable[[str], None] = lambda _: None) -> PublishResult:
    """Deploy ``values`` and keep them only if production is healthy and meets its SLOs.

    ``on_phase`` hears "verifying" before the canary and "rolling_back" before a rollback.
    """
    adopt(target, history)
    values = target.production_values(tidy(values))
    if entry is None:
        entry = history.add("pending", values, source=dict(source or {}))
    else:  # an approved proposal
        entry = history.settle(entry, "pending")
    try:
        target.deploy(values)
        on_phase("verifying")
        result = canary(target.endpoint())
    except AutotuneError as e:
        on_phase("rolling_back")
        return _roll_back(target, history, entry, str(e), None)
    if not result.passed:
        on_phase("rolling_back")
        return _roll_back(target, history, entry, result.reason, result.summary)
    return PublishResult(history.settle(entry, "published", canary=result.summary), True)


def _roll_back(target: Target, history: History, entry: Entry, reason: str,
               canary: dict[str, Any] | None) -> PublishResult:
    good = history.last_good(before=entry.number)
    if good is None:
        history.settle(entry, "rolled-back", reason=f"{reason}; no earlier good config to restore",
                       canary=canary)
        raise AutotuneError(f"publish of entry {entry.number} failed ({reason}) and there is no earlier good "
                            "config to roll back to: production needs a person")
    try:
        target.deploy(good.values)
    except AutotuneError as e:
        history.settle(entry, "rolled-back", reason=f"{reason}; rollback to entry {good.number} FAILED: {e}",
                       canary=canary)
        raise AutotuneError(f"publish of entry {entry.number} failed ({reason}) and the rollback to entry "
                            f"{good.number} failed too ({e}): production needs a person") from e
    return PublishResult(history.settle(entry, "rolled-back", reason=reason, restored=good.number, canary=canary),
                         False)


def rollback_choice(history: History, to: int | None = None) -> Entry:
    """The entry a rollback goes to: ``to``, or the good entry before the current one; a ConfigError
    naming the entries there are when there is no such entry or it is no good config."""
    entries = history.entries()
    good_ones = ", ".join(str(e.number) for e in entries if e.good) or "none"
    if to is not None:
        good = history.get(to)
        if good is None:
            there = (f"the history has entries {entries[0].number} to {entries[-1].number}, of which "
                     f"{good_ones} can be restored" if entries else "the history is empty")
            raise ConfigError(f"there is no history entry {to}: {there} (autotune history lists them)")
        if not good.good:
            raise ConfigError(f"entry {to} is {good.outcome}, not a config production ran well; pick a published "
                              f"or adopted one: {good_ones} (autotune history lists them)")
        return good
    current = next((e for e in reversed(entries) if e.good), None)
    good = history.last_good(before=current.number) if current else None
    if good is None:
        raise ConfigError("no earlier good config to roll back to (autotune history shows the history)")
    return good


def rollback(target: Target, history: History, to: int | None = None) -> Entry | None:
    """By hand: go back to entry ``to`` (default: the good entry before the current one).

    None, with nothing restarted, when production already runs that entry's config."""
    good = rollback_choice(history, to)
    if same_config(target.deployed(), target.production_values(good.values)):
        return None
    target.deploy(good.values)
    return history.add("published", good.values, source={"rollback_to": good.number, "by": "hand"},
                       reason=f"rolled back by hand to entry {good.number}")


def recover(target: Target, history: History, canary: Canary) -> PublishResult | None:
    """After a crash mid-publish: verify the pending entry again, or roll back. None when nothing was open."""
    entry = history.open_entry()
    if entry is None:
        return None
    deployed = target.deployed()
    if deployed != entry.values:
        # the crash came before the new config was written: production still runs the old one
        return PublishResult(history.settle(entry, "rolled-back", reason="interrupted before it was deployed"), False)
    try:
        wait_healthy(target.endpoint(), 60.0)
        result = canary(target.endpoint())
    except AutotuneError as e:
        return _roll_back(target, history, entry, f"interrupted; re-verification failed: {e}", None)
    if not result.passed:
        return _roll_back(target, history, entry, f"interrupted; {result.reason}", result.summary)
    return PublishResult(history.settle(entry, "published", canary=result.summary), True)


class PublishLock:
    """One publish at a time per daemon: the daemon's own and `autotune publish --approve`/`rollback`."""

    def __init__(self, root: Path) -> None:
        self.path = Path(root) / "publish.lock"

    def __enter__(self) -> PublishLock:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "w")
        fcntl.flock(self._f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        import fcntl

        fcntl.flock(self._f, fcntl.LOCK_UN)
        self._f.close()
