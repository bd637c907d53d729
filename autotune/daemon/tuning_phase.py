"""The daemon's tuning phase: a study on staging that imitates production's traffic, from its start to its verdict.

``TuningPhase`` owns the transitions out of ``watching`` into ``tuning`` (``start``) and out of ``tuning``
(``finish``): to ``watching`` with a verdict or without one, to ``awaiting_approval`` with a proposal, or to
``publishing`` (handed to the publishing phase). The tuning itself is a child process (``TuningChild``,
tuning.py) that the daemon's tick polls (``step``); a rollback by hand during it pauses it, and the study
resumes from its storage. Each finished trial gets one journal line, read from the study at each tick.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from optuna.trial import TrialState

from autotune.daemon.fingerprint import Fingerprint
from autotune.daemon.phase import PhaseHost, say
from autotune.daemon.publishing import Publishing
from autotune.daemon.state import Phase, duration_text
from autotune.daemon.tuning import (
    TuningChild,
    choose,
    for_production,
    move_to_gpus,
    production_capacity,
    tuned_keys,
    write_tuning_study,
)
from autotune.errors import AutotuneError
from autotune.publish.transaction import same_config, tidy
from autotune.study.lines import trial_line
from autotune.study.records import StudyResult

__all__ = ["TuningPhase", "RETRY_S"]

RETRY_S = 600.0  # a tuning that reached no verdict: its trigger waits this long (doubling) before the next try


def _demand_note(fp: Fingerprint) -> str:
    """How far the imitated rate is users' demand: the proxy's count is all of it; /metrics under saturation is not."""
    if fp.offered:
        return " (users' requests at the proxy" + (", production could not keep up)" if fp.saturated else ")")
    return " (at least: production could not keep up)" if fp.saturated else ""


class TuningPhase:
    """The daemon's tuning, if one runs: its child process, and what its verdict means for production."""

    def __init__(self, daemon: PhaseHost, publishing: Publishing) -> None:
        self.d = daemon
        self.publishing = publishing  # where a winner is published, and a rollback by hand during a tuning runs
        self.child: TuningChild | None = None

    def start(self, trigger: str, fp: Fingerprint) -> None:
        n = self.d.state.tunings + 1
        name = f"{self.d.cfg.name}-tune-{n:03d}"
        path = self.d.root / "tunings" / f"{name}.toml"
        deployed = self.d.target.deployed()  # what the tuning's `production` baseline measures
        self.write_study(name, path, fp, deployed)
        kind = trigger.split(":")[0].split(" ")[0]
        by_trigger = {**self.d.state.tunings_by_trigger, kind: self.d.state.tunings_by_trigger.get(kind, 0) + 1}
        self.d.enter(
            Phase.TUNING,
            trigger=trigger,
            study_name=name,
            study_file=str(path),
            tunings=n,
            tunings_by_trigger=by_trigger,
            tuning_started=time.time(),
            trials_told=(),
            note=f"tuning {name}: {trigger}; imitating {fp.request_rate or 0:.2f} req/s" + _demand_note(fp),
            tuned_fingerprint=self.d.state.tuned_fingerprint,
            imitated=fp.to_json(),
            breach_streak=0,
            production_values=tidy(deployed) if deployed is not None else None,
        )
        self.spawn()

    def write_study(self, name: str, path: Path, fp: Fingerprint, deployed: dict[str, Any] | None) -> None:
        gpus = self.idle_gpus()
        write_tuning_study(
            self.d.cfg.staging_study,
            self.d.study,
            path,
            name=name,
            slos=[x.text for x in self.d.cfg.slos],
            fingerprint=fp,
            seed=self.d.state.tunings,
            deployed=deployed,
            prefix=f"{self.d.cfg.name}-tune-",
            trace=self.d.cfg.staging_trace,
            engine_env={"CUDA_VISIBLE_DEVICES": gpus} if gpus else None,
        )

    def idle_gpus(self) -> str | None:
        """Blue/green with GPUs per color: the idle color's, where staging runs (None: staging has its own)."""
        idle_gpus = getattr(self.d.target, "idle_gpus", None)
        try:
            return idle_gpus() if idle_gpus is not None else None
        except AutotuneError as e:  # the proxy's file names neither color: say so, keep staging's own GPUs
            self.d.note(f"cannot tell which color is idle ({e}); the tuning keeps the staging study's GPUs")
            return None

    def _production_moved(self) -> str | None:
        """When production's deployed config is no longer the one the running tuning measured as its
        `production` baseline (a rollback or a publish by hand meanwhile): what it runs now, in words."""
        then = self.d.state.production_values
        if then is None:  # a tuning started before the daemon recorded it: nothing to compare
            return None
        try:
            now = self.d.target.deployed()
        except AutotuneError:
            return None
        if now is None or same_config(now, then):
            return None
        changed = sorted(k for k in set(now) | set(then) if tidy(now).get(k) != tidy(then).get(k))
        return ", ".join(f"{k} {then.get(k, 'unset')} -> {tidy(now).get(k, 'unset')}" for k in changed)

    def spawn(self) -> None:
        st = self.d.state
        assert st.study_file is not None  # a tuning's state names its study file (start)
        log = self.d.root / "tunings" / f"{st.study_name}.log"
        self.child = TuningChild(self.d.autotune, Path(st.study_file), log).start()

    def step(self) -> None:
        pub = self.publishing
        if pub.job is not None:  # paused: a rollback by hand holds the idle GPUs
            if not pub.job.done():
                return
            self._rollback_done()
        elif (to := self.d.store.rollback_request()) is not None:
            self._pause_for_rollback(to)
            return
        if self.child is None:
            # the daemon restarted mid-tuning (or a pause ended): the study resumes from its storage
            told = len(self.d.state.trials_told)
            say(f"resuming tuning {self.d.state.study_name} ({told} trial{'s' if told != 1 else ''} finished before)")
            self.spawn()
            return
        self._update_trials()
        rc = self.child.poll()
        if rc is None:
            return
        self.child = None
        self.finish(rc)

    def _update_trials(self, finished: StudyResult | None = None) -> None:
        """The trial gauges: the running study's counts; once it ended (``finished``), nothing runs or waits.
        Each trial that finished since the last tick gets its journal line (``_tell_trials``)."""
        if finished is not None:
            self.d.metrics.set_trials({**finished.counts(), "running": 0, "waiting": 0})
            self._tell_trials(finished)
            return
        name = self.d.state.study_name
        assert name is not None  # a tuning's state names its study (start)
        try:
            result = self.d.read_result(self.d.study.storage, name)
        except Exception:  # noqa: BLE001 - not created yet: what says so depends on the storage backend
            return
        self.d.metrics.set_trials(result.counts())
        self._tell_trials(result)

    def _tell_trials(self, result: StudyResult) -> None:
        """One journal line per finished trial of the running tuning, as its study prints it ("tuning: NAME:
        trial 3 (sampled by tpe) max_num_seqs=24 -> 11.10 req/s within the SLOs ..."), read from its storage
        at each tick: once each (the state keeps which were told, so a restarted daemon does not repeat them)."""
        told = set(self.d.state.trials_told)
        new = [r for r in result.records if r.state.is_finished() and r.number not in told]
        if not new:
            return
        reference = result.best_baseline
        for r in sorted(new, key=lambda r: r.number):
            print(f"{self.d.state.phase.value}: {self.d.state.study_name}: {trial_line(r, reference)}", flush=True)
        self.d.keep(trials_told=tuple(sorted(told | {r.number for r in new})))

    def finish(self, rc: int) -> None:
        st = self.d.state
        assert st.study_name is not None  # a tuning's state names its study (start)
        result = self.result(st.study_name)
        if result is not None:
            self._update_trials(result)
        else:
            self.d.metrics.set_trials({})
        if rc not in (0, 1) or result is None or not any(r.state == TrialState.COMPLETE for r in result.records):
            self._no_verdict(rc, result)
            return
        now = time.time()
        # production's config is now judged against the traffic this tuning imitated, not whatever the window
        # shows at the verdict: drift from here on is drift from what a tuning saw
        tuned = st.imitated or (self.d.fingerprint.to_json() if self.d.fingerprint else st.tuned_fingerprint)
        done = dict(last_tuning_end=now, tuned_fingerprint=tuned, empty_tunings=0, retry_at=0.0)
        held = self._cooldown_text()
        moved = self._production_moved()
        prod_cap = production_capacity(result)
        if prod_cap is not None and moved is None:  # else it measured a config production no longer runs
            self.d.metrics.production_capacity.set(prod_cap)
        if rc == 1 or result.remeasurement is None:
            self.d.decided(Phase.WATCHING, note=f"tuning {st.study_name}: no config met the SLOs{held}", **done)
            return
        choice = choose(result)
        # the capacity of what the tuning stands on: a baseline that ties with the study's winner stands for it
        self.d.metrics.best_capacity.set(result.trial(choice.winner).capacity_rps)
        if moved is not None:
            # its `production` baseline measured a config production no longer runs: a gain over it means nothing
            self.d.decided(
                Phase.WATCHING,
                note=f"tuning {st.study_name}: nothing published: production's config changed "
                f"while it ran ({moved}; a rollback or publish meanwhile), so its production baseline is "
                f"stale{held}; `autotune retune` measures the one it runs now",
                **done,
            )
            return
        if choice.trial is None:
            self.d.decided(
                Phase.WATCHING, note=f"tuning {st.study_name}: production's config stays ({choice.why}){held}", **done
            )
            return
        winner, why = result.trial(choice.trial), choice.why
        # production's own keys stay as they are (the tuning ran from them: _production_moved said so above);
        # staging's own (its tokenizer, its max_model_len) never reach production
        ran = winner.engine_args.values
        values = for_production(st.production_values, ran, tuned_keys(self.d.study, ran))
        source = {
            "study": st.study_name,
            "trial": winner.number,
            "trigger": st.trigger,
            "capacity_rps": winner.capacity_rps,
            "why": why,
            "production": st.production_values,
        }
        if self.d.cfg.approval:
            for old in [e for e in self.d.history.entries() if e.outcome == "proposed"]:
                self.d.history.settle(old, "rejected", reason="replaced by a newer proposal")
            e = self.d.history.add("proposed", values, source=source)
            self.d.decided(
                Phase.AWAITING_APPROVAL,
                note=f"entry {e.number} (trial {winner.number} of {st.study_name}) "
                f"waits for `autotune publish --approve`: {why}",
                **done,
            )
            return
        self.d.decided(Phase.PUBLISHING, note=f"publishing trial {winner.number} of {st.study_name}: {why}", **done)
        self.publishing.submit(values, source)

    def result(self, name: str) -> StudyResult | None:
        try:
            return self.d.read_result(self.d.study.storage, name)
        except Exception:  # noqa: BLE001 - the study never started: what says so depends on the storage backend
            return None

    def _cooldown_text(self) -> str:
        """What a finished tuning means for the next trigger, said where its verdict is (the cooldown is hysteresis:
        a trigger that keeps firing, the same drift, does not start a tuning back to back)."""
        c = self.d.cfg.triggers.cooldown_s
        return f"; triggers wait out the cooldown ({duration_text(c)}), `autotune retune` does not" if c > 0 else ""

    def _no_verdict(self, rc: int, result: StudyResult | None) -> None:
        """A tuning that reached no verdict (it failed, was interrupted, or measured no trial: every config
        failed to start) tuned nothing: it does not start the cooldown nor count for the schedule, and the
        traffic production's config is judged against stays. Its trigger is tried again after a backoff
        (RETRY_S, doubling with each such tuning in a row, never longer than the cooldown), not every tick."""
        st = self.d.state
        n = st.empty_tunings + 1
        wait = min(self.d.cfg.triggers.cooldown_s, RETRY_S * 2 ** min(n - 1, 16))
        if rc not in (0, 1):
            why = f"failed (exit {rc}); see its log {self.d.root / 'tunings' / f'{st.study_name}.log'}"
        else:
            counts = result.counts() if result is not None else {}
            tried = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()) if v) or "none"
            why = f"measured nothing (trials: {tried})"
        self.d.decided(
            Phase.WATCHING,
            note=f"tuning {st.study_name} {why}: no verdict, so no cooldown; "
            + (f"its trigger is tried again in {duration_text(wait)}" if wait > 0 else "its trigger may fire again"),
            empty_tunings=n,
            retry_at=time.time() + wait,
        )

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()

    def _pause_for_rollback(self, to: int) -> None:
        """`autotune rollback` during a tuning on a blue/green production whose idle GPUs staging uses: stop
        the tuning (its study stays resumable), roll back on the publish thread, resume the tuning after."""
        # the request stays until the rollback is done: `autotune rollback` waits for it to go
        self.d.note(f"tuning {self.d.state.study_name} paused: a rollback by hand to entry {to} needs the idle GPUs")
        self.stop()
        self.child = None
        self.publishing.start_rollback(to)

    def _rollback_done(self) -> None:
        try:
            entry = self.publishing.rollback_result()
            done = (
                f"production is back on entry {entry.source['rollback_to']} (entry {entry.number})"
                if entry is not None
                else "production already ran that config: nothing changed"
            )
        except AutotuneError as e:
            done = f"the rollback failed: {e}"
        self.d.history_metrics()
        gpus = self.idle_gpus()
        if gpus and self.d.state.study_file:
            move_to_gpus(
                Path(self.d.state.study_file), gpus
            )  # the colors may have swapped: staging follows the idle one
        note = f"{done}; tuning {self.d.state.study_name} resumes" + (f" on GPUs {gpus}" if gpus else "")
        self.d.note(note, last_decision=note, last_decision_at=time.time())
        self.d.store.clear_rollback_request()
