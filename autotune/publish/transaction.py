"""Publishing as a transaction: production ends on the new config verified, or on the last good one.

    record pending -> deploy (validate, write atomically, restart, wait for health)
                   -> canary (a short replay against the SLOs)
                   -> published                                     all passed
                   -> deploy the last good config -> rolled-back    anything failed

A target is anything target.Target describes: a vLLM YAML config with a restart command
(vllm_config.py) or an Xinference model (xinference.py). The
canary is a callable so the daemon can build it from production's own traffic and a person
running ``autotune publish`` from the study's workload.

A blue/green target (bluegreen.py) publishes as a switch instead, each step written into the
entry's ``switch`` before it starts, so a crash anywhere resumes (``recover``) to one color serving:

    starting  the idle color restarts with the new config    fails: stop it; production never noticed
    canary    the canary replays against the idle color      fails: stop it; production never noticed
    switching the proxy is pointed at it                     fails: the proxy stays; stop it
    verifying production's SLOs over a window (``verify``)  fails: switching-back, stop it: rolled-back
    retiring  the old color stops                            -> published
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.errors import AutotuneError, ConfigError
from autotune.publish.bluegreen import BlueGreenTarget, Color
from autotune.publish.history import NOT_DEPLOYED, Entry, History
from autotune.publish.target import Target, wait_healthy

__all__ = [
    "CanaryResult",
    "PublishResult",
    "publish",
    "rollback",
    "rollback_choice",
    "recover",
    "adopt",
    "PublishLock",
    "tidy",
    "same_config",
]


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


def publish(
    target: Target,
    values: Mapping[str, Any],
    history: History,
    canary: Canary,
    source: Mapping[str, Any] | None = None,
    entry: Entry | None = None,
    on_phase: Callable[[str], None] = lambda _: None,
    verify: Canary | None = None,
) -> PublishResult:
    """Deploy ``values`` and keep them only if production is healthy and meets its SLOs.

    ``on_phase`` hears "verifying" before the canary and "rolling_back" before a rollback; a blue/green
    switch also tells its steps ("switching", "watching production", "retiring"). ``verify`` judges
    production after a blue/green switch (the daemon watches its /metrics); default: the canary again.
    """
    adopt(target, history)
    values = target.production_values(tidy(values))
    if entry is None:
        entry = history.add("pending", values, source=dict(source or {}))
    else:  # an approved proposal: its source, and what the approver added ("approved": "by hand")
        entry = history.settle(entry, "pending", source={**entry.source, **dict(source or {})})
    if isinstance(target, BlueGreenTarget):
        return _switch(target, entry, history, canary, verify or canary, on_phase)
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


def _step(history: History, entry: Entry, step: str, old: Color, new: Color, **kw: Any) -> Entry:
    return history.settle(entry, "pending", switch={"from": old.name, "to": new.name, "step": step}, **kw)


def _switch(
    target: BlueGreenTarget,
    entry: Entry,
    history: History,
    canary: Canary,
    verify: Canary,
    on_phase: Callable[[str], None],
) -> PublishResult:
    old = target.live()
    new = target.other(old)
    good = history.last_good(before=entry.number)
    entry = _step(history, entry, "starting", old, new)
    try:
        url = target.stage(new, entry.values)
        entry = _step(history, entry, "canary", old, new)
        on_phase("verifying")
        result = canary(url)
    except AutotuneError as e:
        return _abandon(target, history, entry, new, f"{e}", None, old, good)
    if not result.passed:
        return _abandon(target, history, entry, new, result.reason, result.summary, old, good)
    entry = _step(history, entry, "switching", old, new, canary=result.summary)
    on_phase("switching")
    try:
        target.switch(new)
    except AutotuneError as e:  # the proxy kept (or got back) its old file: users stayed on the old color
        return _abandon(target, history, entry, new, f"the switch failed: {e}", result.summary, old, good)
    entry = _step(history, entry, "verifying", old, new)
    on_phase("watching production")
    return _verify_switched(target, history, entry, verify, old, new, good)


def _verify_switched(
    target: BlueGreenTarget,
    history: History,
    entry: Entry,
    verify: Canary,
    old: Color,
    new: Color,
    good: Entry | None,
    why: str = "",
) -> PublishResult:
    """After the switch: keep it if production meets its SLOs, else switch back to ``old`` (still up)."""
    try:
        after = verify(new.url)
        passed, reason, summary = after.passed, after.reason if not after.passed else "", after.summary
    except AutotuneError as e:
        passed, reason, summary = False, f"verification failed: {e}", None
    if passed:
        entry = _step(history, entry, "retiring", old, new)
        assert entry.switch is not None  # _step wrote it
        target.drain(old)  # streams that started before the switch finish there
        on_stop = target.stop_quietly(old)
        said = [f"{old.name} did not stop: {on_stop}"] if on_stop else []
        if summary is not None and summary.get("verified") is False:  # kept on the canary's word alone: say so
            said.append(f"not verified on users' traffic ({summary.get('note', 'too few requests')})")
        return PublishResult(
            history.settle(
                entry, "published", switch={**entry.switch, "step": "done", "verified": summary}, reason="; ".join(said)
            ),
            True,
        )
    return _switch_back(target, history, entry, old, new, good, f"{why}after the switch: {reason}", summary)


def _switch_back(
    target: BlueGreenTarget,
    history: History,
    entry: Entry,
    old: Color,
    new: Color,
    good: Entry | None,
    reason: str,
    verified: dict[str, Any] | None,
) -> PublishResult:
    entry = _step(history, entry, "switching-back", old, new)
    assert entry.switch is not None  # _step wrote it
    try:
        try:
            wait_healthy(old.url, 5.0, 0.5)
        except AutotuneError:  # the old color is gone (stopped by hand, or crashed): start it on its own YAML again
            target.stage(old, old.server.deployed() or {})
        target.switch(old)
    except AutotuneError as e:
        history.settle(
            entry,
            "rolled-back",
            reason=f"{reason}; switching back to {old.name} FAILED: {e}",
            switch={**entry.switch, "verified": verified},
        )
        raise AutotuneError(
            f"publish of entry {entry.number} failed ({reason}) and switching back to {old.name} "
            f"failed too ({e}): production needs a person"
        ) from e
    target.drain(new)
    target.stop_quietly(new)
    return PublishResult(
        history.settle(
            entry,
            "rolled-back",
            reason=reason,
            restored=good.number if good else None,
            switch={**entry.switch, "step": "switched back", "verified": verified},
        ),
        False,
    )


def _abandon(
    target: BlueGreenTarget,
    history: History,
    entry: Entry,
    new: Color,
    reason: str,
    canary: dict[str, Any] | None,
    old: Color,
    good: Entry | None,
) -> PublishResult:
    """A failure before users reached the new color: stop it; production never noticed."""
    target.stop_quietly(new)
    return PublishResult(
        history.settle(
            entry,
            "rolled-back",
            canary=canary,
            reason=f"{reason} (before the switch: production stayed on {old.name})",
            restored=good.number if good else None,
            switch={**(entry.switch or {}), "step": "abandoned"},
        ),
        False,
    )


def _recover_switch(target: BlueGreenTarget, history: History, entry: Entry, verify: Canary) -> PublishResult:
    """A blue/green publish a crash interrupted: the proxy's file says which color serves; make the rest agree."""
    sw = entry.switch or {}
    old, new = target.color(sw["from"]), target.color(sw["to"])
    good = history.last_good(before=entry.number)
    live = target.resync()
    step = sw.get("step", "starting")
    if step == "switching-back":
        return _switch_back(
            target, history, entry, old, new, good, "interrupted while switching back after a failed verification", None
        )
    if live is old:
        return _abandon(target, history, entry, new, f"interrupted at step {step}", entry.canary, old, good)
    if step == "retiring":  # verified before the crash: only the old color's stop was left
        return _verify_switched(
            target,
            history,
            entry,
            lambda _: CanaryResult(True, {"note": "verified before the interruption"}),
            old,
            new,
            good,
        )
    return _verify_switched(target, history, entry, verify, old, new, good, why=f"interrupted at step {step}; ")


def _roll_back(
    target: Target, history: History, entry: Entry, reason: str, canary: dict[str, Any] | None
) -> PublishResult:
    good = history.last_good(before=entry.number)
    if good is None:
        history.settle(entry, "rolled-back", reason=f"{reason}; no earlier good config to restore", canary=canary)
        raise AutotuneError(
            f"publish of entry {entry.number} failed ({reason}) and there is no earlier good "
            "config to roll back to: production needs a person"
        )
    try:
        target.deploy(good.values)
    except AutotuneError as e:
        history.settle(
            entry, "rolled-back", reason=f"{reason}; rollback to entry {good.number} FAILED: {e}", canary=canary
        )
        raise AutotuneError(
            f"publish of entry {entry.number} failed ({reason}) and the rollback to entry "
            f"{good.number} failed too ({e}): production needs a person"
        ) from e
    return PublishResult(
        history.settle(entry, "rolled-back", reason=reason, restored=good.number, canary=canary), False
    )


def rollback_choice(history: History, to: int | None = None) -> Entry:
    """The entry a rollback goes to: ``to``, or the good entry before the current one; a ConfigError
    naming the entries there are when there is no such entry or it is no good config."""
    entries = history.entries()
    good_ones = ", ".join(str(e.number) for e in entries if e.good) or "none"
    if to is not None:
        good = history.get(to)
        if good is None:
            there = (
                f"the history has entries {entries[0].number} to {entries[-1].number}, of which "
                f"{good_ones} can be restored"
                if entries
                else "the history is empty"
            )
            raise ConfigError(f"there is no history entry {to}: {there} (autotune history lists them)")
        if not good.good:
            raise ConfigError(
                f"entry {to} is {good.outcome}, not a config production ran well; pick a published "
                f"or adopted one: {good_ones} (autotune history lists them)"
            )
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
    return history.add(
        "published",
        good.values,
        source={"rollback_to": good.number, "by": "hand"},
        reason=f"rolled back by hand to entry {good.number}",
    )


def recover(target: Target, history: History, canary: Canary, verify: Canary | None = None) -> PublishResult | None:
    """After a crash mid-publish: verify the pending entry again, or roll back. None when nothing was open."""
    entry = history.open_entry()
    if entry is None:
        return None
    if isinstance(target, BlueGreenTarget) and entry.switch:
        return _recover_switch(target, history, entry, verify or canary)
    deployed = target.deployed()
    if deployed != entry.values:
        # the crash came before the new config was written: production still runs the old one
        return PublishResult(history.settle(entry, "rolled-back", reason=NOT_DEPLOYED), False)
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
