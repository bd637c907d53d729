"""The daemon: watch production, re-tune on staging when its traffic drifts, publish safely.

One thread ticks every scrape interval: it pings systemd's watchdog, scrapes production,
updates the metrics, and advances the state machine (state.py). Long work never runs on it:

- a tuning is a child process (tuning.py): ``autotune study`` on a study derived from the
  staging study; a daemon restart resumes it, and leftover records reap its engine should the
  daemon die with -9;
- a publish is a transaction (publish.transaction) on a worker thread; the tick only follows
  its phase and keeps the watchdog fed through a 15-minute health wait. A proposal a person
  approves (`autotune publish --approve` leaves the approval in the state directory) is published
  the same way, on this loop.

What the daemon decides on is checked against what production is: a tuning remembers the config
production ran when it started (its `production` baseline), and publishes nothing when production
runs another one by the time it ends (a rollback meanwhile); after every publish or rollback,
whoever made it, the watcher starts a new window, so the canary's requests are never read as
production's traffic.

Everything needed to resume is in the state file and the publish history under the state
directory (the config's ``state_dir``, else $STATE_DIRECTORY under systemd); the publish and
rollback metrics are read back from that history, so a restart keeps them and a rollback by hand
(`autotune rollback`, another process) counts.

The journal (stdout and stderr under systemd) gets one line per phase change and per new decision
or reason: the trigger and its numbers, each finished trial of a tuning (read from its study at each
tick), a tuning's verdict with its gain and spread, a publish, its canary, a rollback and why, on stdout
as "<phase>: <note>"; production's metrics failing and answering again, on stderr.
"""

from __future__ import annotations

import concurrent.futures
import datetime as dt
import re
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
from optuna.trial import TrialState

from autotune.daemon import notify
from autotune.daemon.arrivals import ArrivalLog
from autotune.daemon.config import DaemonConfig, load_daemon_config
from autotune.daemon.exporter import DaemonMetrics
from autotune.daemon.fingerprint import Fingerprint, drift
from autotune.daemon.production import build_target, daemon_root, production_canary, switch_verifier
from autotune.daemon.state import DaemonState, Observation, Phase, StateStore, decide, duration_text
from autotune.daemon.tuning import (
    TuningChild,
    choose,
    for_production,
    load_staging,
    move_to_gpus,
    production_capacity,
    tuned_keys,
    write_tuning_study,
)
from autotune.daemon.watcher import Watcher
from autotune.errors import AutotuneError
from autotune.publish.history import Entry, History
from autotune.publish.target import Target
from autotune.publish.transaction import Canary, PublishLock, adopt, publish, recover, rollback, same_config, tidy
from autotune.study.lines import trial_line
from autotune.study.records import StudyResult

__all__ = ["Daemon"]

MIN_REQUESTS = 20  # a window with fewer finished requests says too little about the traffic
FULL_WINDOW = 0.98  # of window_s: a window is judged once it spans that much (ticks land a little early or late)
RETRY_S = 600.0  # a tuning that reached no verdict: its trigger waits this long (doubling) before the next try


def _shape(note: str) -> str:
    """A note without its numbers: what stays the same while a wait counts down."""
    return re.sub(r"\d+(\.\d+)?", "#", note)


def _say(text: str) -> None:
    print(f"autotune: {text}", file=sys.stderr, flush=True)


def _demand_note(fp: Fingerprint) -> str:
    """How far the imitated rate is users' demand: the proxy's count is all of it; /metrics under saturation is not."""
    if fp.offered:
        return " (users' requests at the proxy" + (", production could not keep up)" if fp.saturated else ")")
    return " (at least: production could not keep up)" if fp.saturated else ""


class Daemon:
    def __init__(
        self,
        cfg: DaemonConfig,
        *,
        target: Target | None = None,
        root: Path | None = None,
        metrics: DaemonMetrics | None = None,
        autotune_argv: list[str] | None = None,
    ) -> None:
        self.cfg = cfg
        self.root = root or daemon_root(cfg)
        self.store = StateStore(self.root)
        self.history = History(self.root / "history")
        self.target = target or build_target(cfg)
        self.metrics = metrics or DaemonMetrics()
        self.watcher = Watcher(
            cfg.production.url,
            window_s=cfg.window_s,
            arrivals=ArrivalLog(cfg.arrivals_log) if cfg.arrivals_log else None,
        )
        self.study = load_staging(cfg.staging_study, self.root)  # the template: checked now, not at the first drift
        self.autotune = autotune_argv or [sys.executable, "-m", "autotune"]
        self.state = self.store.load()
        self.fingerprint: Fingerprint | None = None
        self._lock = threading.Lock()
        self._child: TuningChild | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish")
        self._job: concurrent.futures.Future[Any] | None = None
        self._failed_scrapes = 0  # in the current streak
        self._capacities: dict[str, float | None] = {}  # a finished tuning's measurement of production, by study
        self._settled = self._last_settled()  # the last publish or rollback the watcher's window starts after
        self._told: set[int] = set()  # rollbacks by hand this daemon ran and said itself

    # -- the loop ------------------------------------------------------------------------------

    def run(self, stop: threading.Event, reload: threading.Event | None = None) -> int:
        """Tick until ``stop`` is set; when ``reload`` is set (SIGHUP), re-read the config file between ticks."""
        if self.cfg.metrics_listen:
            self.metrics.serve(*self.cfg.metrics_listen)
        self._resume()
        notify.ready()
        # systemd restarts a daemon that stays silent for WatchdogSec: tick at least twice as often
        wd = notify.watchdog_interval()
        try:
            while not stop.is_set():
                if reload is not None and reload.is_set():
                    reload.clear()
                    notify.reloading()
                    self.reload()
                    notify.ready()
                self.tick()
                interval = min(self.cfg.scrape_interval_s, wd / 2) if wd else self.cfg.scrape_interval_s
                stop.wait(interval)
        finally:
            notify.stopping()
            self._stop_child()
            self._pool.shutdown(wait=True)  # a publish in flight finishes: never leave production half-done
            self.watcher.close()
        return 0

    def reload(self) -> None:
        """Re-read the config file (``systemctl reload``, SIGHUP) without touching a running tuning or publish.

        Everything applies at the next tick (SLOs, triggers, windows, approval, the staging study for the
        next tuning, production's target once no publish is in flight) except what names where the daemon
        lives or listens: its name, state_dir, [metrics].listen and production's URL keep their running
        values until a restart, and the journal says so. A file that does not load changes nothing.
        """
        path = self.cfg.source
        if path is None:
            return
        try:
            new = load_daemon_config(path)
            study = load_staging(new.staging_study, self.root)
        except AutotuneError as e:
            _say(f"reload: {path} not applied, the running config stays: {e}")
            return
        held = [
            name
            for name, old, now in (
                ("name", self.cfg.name, new.name),
                ("state_dir", self.cfg.state_dir, new.state_dir),
                ("[metrics].listen", self.cfg.metrics_listen, new.metrics_listen),
                ("[production].url", self.cfg.production.url, new.production.url),
            )
            if old != now
        ]
        new = replace(
            new,
            name=self.cfg.name,
            state_dir=self.cfg.state_dir,
            metrics_listen=self.cfg.metrics_listen,
            production=replace(new.production, url=self.cfg.production.url),
        )
        if new.production != self.cfg.production and self._job is None:
            self.target = build_target(new)
        if new.arrivals_log != self.cfg.arrivals_log:  # new totals: no window may span the old reader's and the new
            if self.watcher.arrivals is not None:
                self.watcher.arrivals.close()
            self.watcher.arrivals = ArrivalLog(new.arrivals_log) if new.arrivals_log else None
            self.watcher.restart_window()
        self.cfg, self.study = new, study
        self.watcher.window_s = new.window_s
        _say(f"reloaded {path}" + (f"; {', '.join(held)} changed and take a restart" if held else ""))

    def tick(self) -> None:
        notify.watchdog()
        obs = self._observe()
        phase = self.state.phase
        if phase is Phase.WATCHING:
            self._watching(obs)
        elif phase is Phase.TUNING:
            self._tuning()
        elif phase is Phase.AWAITING_APPROVAL:
            self._awaiting_approval()
        elif self._job is not None and self._job.done():
            self._publish_done()
        entries = self._entries()  # once per tick, after the phase's own step: what it settled counts now
        self._after_publishes(entries)
        self.metrics.set_phase(self.state.phase.value)
        self.metrics.set_tunings(self._tunings_by_trigger())
        self._history_metrics(entries)
        notify.status(f"{self.state.phase.value}: {self.state.note}"[:200])

    def _set(self, phase: Phase, **changes: Any) -> None:
        with self._lock:
            before = self.state
            self.state = self.store.save(self.state.to(phase, **changes))
        self._journal(before)

    def _decide(self, phase: Phase, note: str, **changes: Any) -> None:
        """A phase change that is a decision (a tuning's verdict, a publish or a proposal, its outcome): its note
        is kept as the last decision too, which `autotune status` shows once later notes ("watching") replaced it."""
        self._set(phase, note=note, last_decision=note, last_decision_at=time.time(), **changes)

    def _note(self, text: str, **changes: Any) -> None:
        self._keep(note=text, **changes)

    def _keep(self, **changes: Any) -> None:
        with self._lock:
            before = self.state
            self.state = self.store.save(replace(self.state, **changes))
        self._journal(before)

    def _journal(self, before: DaemonState) -> None:
        """One stdout line (the journal, under systemd) per phase change and per new decision or reason.

        A note that only counts down ("cooldown: 5 h 12 min left", then 11 min) is the same decision: the
        numbers are left out of the comparison, so a steady daemon writes nothing new every tick.
        """
        now = self.state
        if now.phase is before.phase and _shape(now.note) == _shape(before.note):
            return
        print(f"{now.phase.value}: {now.note}", flush=True)

    # -- watching ------------------------------------------------------------------------------

    def _entries(self) -> list[Entry] | None:
        """The publish history, read once per tick (None: an entry is damaged; the history's own commands say which)."""
        try:
            return self.history.entries()
        except AutotuneError:
            return None

    def _last_settled(self, entries: list[Entry] | None = None) -> tuple[int, str] | None:
        """The newest publish or rollback in the history (its number and outcome), whoever made it."""
        if entries is None:
            entries = self._entries()
        done = [e for e in entries or [] if e.outcome in ("published", "rolled-back")]
        return (done[-1].number, done[-1].outcome) if done else None

    def _after_publishes(self, entries: list[Entry] | None) -> None:
        """A publish or rollback ended (the daemon's, or `autotune publish`/`rollback` in another process):
        production restarted and served the canary, whose requests /metrics counts as production's. No
        window may span them: the watcher starts a new one at its next scrape, and the fingerprint of
        the old one is forgotten, so the next trigger judges users' traffic only."""
        if entries is None:  # unreadable this tick: nothing known to have changed
            return
        settled = self._last_settled(entries)
        if settled == self._settled:
            return
        assert settled is not None  # a history only grows: once one was settled, the newest settled one exists
        self._settled = settled
        self.watcher.restart_window()
        self.fingerprint = None
        last = next(e for e in reversed(entries) if e.number == settled[0])
        if "rollback_to" in last.source and last.number not in self._told:  # `autotune rollback` elsewhere: said too
            self._decide(
                self.state.phase,
                note=f"production rolled back by hand to entry {last.source['rollback_to']} "
                f"(entry {last.number}); the traffic window starts again",
            )

    def _observe(self) -> Observation | None:
        window = self.watcher.poll()
        self._scrape_news()
        if window is None:
            return None
        compliance = window.slo_compliance(self.cfg.slos)
        self.metrics.set_slos(compliance)
        if window.request_rate is not None:
            self.metrics.request_rate.set(window.request_rate)
        if window.dt < FULL_WINDOW * self.cfg.window_s:  # a part window's mean reads steady traffic as drift
            return Observation(None, None)
        # the proxy counts a saturated production's demand whatever finished, and what finished still tells the
        # lengths, so users who give up (and finish nothing) cannot keep the daemon from imitating them
        counted = window.saturated and window.offered and window.requests > 0
        if window.requests < MIN_REQUESTS and not counted:
            # too few finished to judge latencies or imitate the traffic, but a queue that never empties
            # says enough: few finish because production cannot keep up
            return Observation(None, True, saturated=True) if window.saturated else Observation(None, None)
        # a jump in the rate shows first in the window's newest scrapes: two of them are enough when they say so clearly
        fp = Fingerprint.of(window, self.watcher.since_change(2 * self.cfg.scrape_interval_s))
        self.fingerprint = fp
        if self.state.tuned_fingerprint is None:  # the traffic production's config is judged against from now on
            self._note("first full window: traffic fingerprint recorded", tuned_fingerprint=fp.to_json())
        tuned = self.state.tuned_fingerprint
        assert tuned is not None  # recorded just above when it was not yet
        score = drift(Fingerprint.from_json(tuned), fp)
        self.metrics.drift.set(score)
        # only latency SLOs judge production: its throughput is what users sent, not what it can do
        known = [e.holds for e in compliance if e.holds is not None and e.slo.is_latency]
        if window.saturated:  # its latencies grow with the queue, whatever the finished requests say so far
            return Observation(score, True, saturated=True)
        return Observation(score, (not all(known)) if known else None)

    def _scrape_news(self) -> None:
        """Say when production's metrics stop answering and when they answer again: once per streak, not once
        per scrape. The last error stays in the state, for ``autotune status``."""
        w = self.watcher
        where = f"{w.url}/metrics"
        if w.consecutive_errors:
            self.metrics.scrape_errors.inc()
            self._failed_scrapes = w.consecutive_errors
            if w.consecutive_errors == 1:
                _say(
                    f"cannot scrape production ({where}): {w.last_error}{self._serving_engine_down()}; retrying "
                    f"every {self.cfg.scrape_interval_s:g} s, quiet until it works again"
                )
            error = f"{where}: {w.last_error}"
            if not self.state.scrape_failing or self.state.scrape_error != error:
                self._keep(scrape_error=error, scrape_error_at=time.time(), scrape_failing=True)
        elif self.state.scrape_failing:
            n, self._failed_scrapes = self._failed_scrapes, 0
            _say(f"scraping production works again ({where})" + (f" after {n} failed scrapes" if n else ""))
            self._keep(scrape_failing=False)

    def _serving_engine_down(self) -> str:
        """Behind a proxy: whether the color it serves through answers /health itself, said as part of the
        scrape's journal line ("" when it does, or when production is no blue/green pair)."""
        live = getattr(self.target, "live", None)
        if live is None or self._job is not None:  # a publish in flight moves colors on purpose
            return ""
        try:
            color = live()
            httpx.get(f"{color.url}/health", timeout=2.0, trust_env=False).raise_for_status()
        except AutotuneError:
            return ""  # the proxy's file names no color: the publish commands say what to write
        except httpx.HTTPError as e:
            return (
                f"; {color.name} ({color.url}), the color serving users, does not answer /health either "
                f"({type(e).__name__}): its engine crashed or is restarting (vllm@.service's Restart=on-failure "
                "starts it again from its YAML)"
            )
        return ""

    def _watching(self, obs: Observation | None) -> None:
        now = time.time()
        t = self.cfg.triggers
        # a request by hand stays pending (its file stays) until a tuning starts: outside the tuning windows
        # it waits for one, as any trigger does, and `autotune status` says so
        manual = self.store.retune_request()
        d = decide(
            self.state,
            obs,
            now=now,
            drift_threshold=t.drift,
            breach_windows=t.breach_windows,
            every_s=t.every_s,
            cooldown_s=t.cooldown_s,
            in_window=self.cfg.may_tune_at(dt.datetime.now()),
            manual=manual,
            windows=self.cfg.windows_text(),
        )
        if d.trigger is None:
            note = d.waiting or "watching"
            if self.state.scrape_failing:
                note += f"; cannot scrape production: {self.state.scrape_error}"
            self._note(note, breach_streak=d.breach_streak)
            return
        if self.fingerprint is None:
            self._note(f"{d.trigger}; waiting for a full window of traffic to imitate", breach_streak=d.breach_streak)
            return
        if manual is not None:
            self.store.clear_retune_request()  # taken: this tuning is the one it asked for
        self._start_tuning(d.trigger, self.fingerprint)

    # -- tuning --------------------------------------------------------------------------------

    def _start_tuning(self, trigger: str, fp: Fingerprint) -> None:
        n = self.state.tunings + 1
        name = f"{self.cfg.name}-tune-{n:03d}"
        path = self.root / "tunings" / f"{name}.toml"
        deployed = self.target.deployed()  # what the tuning's `production` baseline measures
        self._write_tuning_study(name, path, fp, deployed)
        kind = trigger.split(":")[0].split(" ")[0]
        by_trigger = {**self.state.tunings_by_trigger, kind: self.state.tunings_by_trigger.get(kind, 0) + 1}
        self._set(
            Phase.TUNING,
            trigger=trigger,
            study_name=name,
            study_file=str(path),
            tunings=n,
            tunings_by_trigger=by_trigger,
            tuning_started=time.time(),
            trials_told=(),
            note=f"tuning {name}: {trigger}; imitating {fp.request_rate or 0:.2f} req/s" + _demand_note(fp),
            tuned_fingerprint=self.state.tuned_fingerprint,
            imitated=fp.to_json(),
            breach_streak=0,
            production_values=tidy(deployed) if deployed is not None else None,
        )
        self._spawn()

    def _write_tuning_study(self, name: str, path: Path, fp: Fingerprint, deployed: dict[str, Any] | None) -> None:
        gpus = self._idle_gpus()
        write_tuning_study(
            self.cfg.staging_study,
            self.study,
            path,
            name=name,
            slos=[x.text for x in self.cfg.slos],
            fingerprint=fp,
            seed=self.state.tunings,
            deployed=deployed,
            prefix=f"{self.cfg.name}-tune-",
            trace=self.cfg.staging_trace,
            engine_env={"CUDA_VISIBLE_DEVICES": gpus} if gpus else None,
        )

    def _idle_gpus(self) -> str | None:
        """Blue/green with GPUs per color: the idle color's, where staging runs (None: staging has its own)."""
        idle_gpus = getattr(self.target, "idle_gpus", None)
        try:
            return idle_gpus() if idle_gpus is not None else None
        except AutotuneError as e:  # the proxy's file names neither color: say so, keep staging's own GPUs
            self._note(f"cannot tell which color is idle ({e}); the tuning keeps the staging study's GPUs")
            return None

    def _production_moved(self) -> str | None:
        """When production's deployed config is no longer the one the running tuning measured as its
        `production` baseline (a rollback or a publish by hand meanwhile): what it runs now, in words."""
        then = self.state.production_values
        if then is None:  # a tuning started before the daemon recorded it: nothing to compare
            return None
        try:
            now = self.target.deployed()
        except AutotuneError:
            return None
        if now is None or same_config(now, then):
            return None
        changed = sorted(k for k in set(now) | set(then) if tidy(now).get(k) != tidy(then).get(k))
        return ", ".join(f"{k} {then.get(k, 'unset')} -> {tidy(now).get(k, 'unset')}" for k in changed)

    def _spawn(self) -> None:
        st = self.state
        assert st.study_file is not None  # a tuning's state names its study file (_start_tuning)
        self._child = TuningChild(self.autotune, Path(st.study_file), self.root / "tunings" / f"{st.study_name}.log")

    def _tuning(self) -> None:
        if self._job is not None:  # paused: a rollback by hand holds the idle GPUs
            if not self._job.done():
                return
            self._rollback_done()
        elif (to := self.store.rollback_request()) is not None:
            self._pause_for_rollback(to)
            return
        if self._child is None:
            # the daemon restarted mid-tuning (or a pause ended): the study resumes from its storage
            told = len(self.state.trials_told)
            _say(f"resuming tuning {self.state.study_name} ({told} trial{'s' if told != 1 else ''} finished before)")
            self._spawn()
            return
        self._update_trials()
        rc = self._child.poll()
        if rc is None:
            return
        self._child = None
        self._finish_tuning(rc)

    def _update_trials(self, finished: StudyResult | None = None) -> None:
        """The trial gauges: the running study's counts; once it ended (``finished``), nothing runs or waits.
        Each trial that finished since the last tick gets its journal line (``_tell_trials``)."""
        if finished is not None:
            self.metrics.set_trials({**finished.counts(), "running": 0, "waiting": 0})
            self._tell_trials(finished)
            return
        name = self.state.study_name
        assert name is not None  # a tuning's state names its study (_start_tuning)
        try:
            result = StudyResult.load(self.study.storage, name)
        except Exception:  # noqa: BLE001 - not created yet: what says so depends on the storage backend
            return
        self.metrics.set_trials(result.counts())
        self._tell_trials(result)

    def _tell_trials(self, result: StudyResult) -> None:
        """One journal line per finished trial of the running tuning, as its study prints it ("tuning: NAME:
        trial 3 (sampled by tpe) max_num_seqs=24 -> 11.10 req/s within the SLOs ..."), read from its storage
        at each tick: once each (the state keeps which were told, so a restarted daemon does not repeat them)."""
        told = set(self.state.trials_told)
        new = [r for r in result.records if r.state.is_finished() and r.number not in told]
        if not new:
            return
        reference = result.best_baseline
        for r in sorted(new, key=lambda r: r.number):
            print(f"{self.state.phase.value}: {self.state.study_name}: {trial_line(r, reference)}", flush=True)
        self._keep(trials_told=tuple(sorted(told | {r.number for r in new})))

    def _finish_tuning(self, rc: int) -> None:
        st = self.state
        assert st.study_name is not None  # a tuning's state names its study (_start_tuning)
        result = self._tuning_result(st.study_name)
        if result is not None:
            self._update_trials(result)
        else:
            self.metrics.set_trials({})
        if rc not in (0, 1) or result is None or not any(r.state == TrialState.COMPLETE for r in result.records):
            self._no_verdict(rc, result)
            return
        now = time.time()
        # production's config is now judged against the traffic this tuning imitated, not whatever the window
        # shows at the verdict: drift from here on is drift from what a tuning saw
        tuned = st.imitated or (self.fingerprint.to_json() if self.fingerprint else st.tuned_fingerprint)
        done = dict(last_tuning_end=now, tuned_fingerprint=tuned, empty_tunings=0, retry_at=0.0)
        held = self._cooldown_text()
        moved = self._production_moved()
        prod_cap = production_capacity(result)
        if prod_cap is not None and moved is None:  # else it measured a config production no longer runs
            self.metrics.production_capacity.set(prod_cap)
        if rc == 1 or result.remeasurement is None:
            self._decide(Phase.WATCHING, note=f"tuning {st.study_name}: no config met the SLOs{held}", **done)
            return
        self.metrics.best_capacity.set(result.trial(result.remeasurement.winner_trial).capacity_rps)
        if moved is not None:
            # its `production` baseline measured a config production no longer runs: a gain over it means nothing
            self._decide(
                Phase.WATCHING,
                note=f"tuning {st.study_name}: nothing published: production's config changed "
                f"while it ran ({moved}; a rollback or publish meanwhile), so its production baseline is "
                f"stale{held}; `autotune retune` measures the one it runs now",
                **done,
            )
            return
        choice = choose(result)
        if choice.trial is None:
            self._decide(
                Phase.WATCHING, note=f"tuning {st.study_name}: production's config stays ({choice.why}){held}", **done
            )
            return
        winner, why = result.trial(choice.trial), choice.why
        # production's own keys stay as they are (the tuning ran from them: _production_moved said so above);
        # staging's own (its tokenizer, its max_model_len) never reach production
        ran = winner.engine_args.values
        values = for_production(st.production_values, ran, tuned_keys(self.study, ran))
        source = {
            "study": st.study_name,
            "trial": winner.number,
            "trigger": st.trigger,
            "capacity_rps": winner.capacity_rps,
            "why": why,
            "production": st.production_values,
        }
        if self.cfg.approval:
            for old in [e for e in self.history.entries() if e.outcome == "proposed"]:
                self.history.settle(old, "rejected", reason="replaced by a newer proposal")
            e = self.history.add("proposed", values, source=source)
            self._decide(
                Phase.AWAITING_APPROVAL,
                note=f"entry {e.number} (trial {winner.number} of {st.study_name}) "
                f"waits for `autotune publish --approve`: {why}",
                **done,
            )
            return
        self._decide(Phase.PUBLISHING, note=f"publishing trial {winner.number} of {st.study_name}: {why}", **done)
        self._job = self._pool.submit(self._publish, values, source)

    def _tuning_result(self, name: str) -> StudyResult | None:
        try:
            return StudyResult.load(self.study.storage, name)
        except Exception:  # noqa: BLE001 - the study never started: what says so depends on the storage backend
            return None

    def _cooldown_text(self) -> str:
        """What a finished tuning means for the next trigger, said where its verdict is (the cooldown is hysteresis:
        a trigger that keeps firing, the same drift, does not start a tuning back to back)."""
        c = self.cfg.triggers.cooldown_s
        return f"; triggers wait out the cooldown ({duration_text(c)}), `autotune retune` does not" if c > 0 else ""

    def _no_verdict(self, rc: int, result: StudyResult | None) -> None:
        """A tuning that reached no verdict (it failed, was interrupted, or measured no trial: every config
        failed to start) tuned nothing: it does not start the cooldown nor count for the schedule, and the
        traffic production's config is judged against stays. Its trigger is tried again after a backoff
        (RETRY_S, doubling with each such tuning in a row, never longer than the cooldown), not every tick."""
        st = self.state
        n = st.empty_tunings + 1
        wait = min(self.cfg.triggers.cooldown_s, RETRY_S * 2 ** min(n - 1, 16))
        if rc not in (0, 1):
            why = f"failed (exit {rc}); see its log {self.root / 'tunings' / f'{st.study_name}.log'}"
        else:
            counts = result.counts() if result is not None else {}
            tried = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()) if v) or "none"
            why = f"measured nothing (trials: {tried})"
        self._decide(
            Phase.WATCHING,
            note=f"tuning {st.study_name} {why}: no verdict, so no cooldown; "
            + (f"its trigger is tried again in {duration_text(wait)}" if wait > 0 else "its trigger may fire again"),
            empty_tunings=n,
            retry_at=time.time() + wait,
        )

    def _stop_child(self) -> None:
        if self._child is not None:
            self._child.stop()

    def _pause_for_rollback(self, to: int) -> None:
        """`autotune rollback` during a tuning on a blue/green production whose idle GPUs staging uses: stop
        the tuning (its study stays resumable), roll back on the publish thread, resume the tuning after."""
        # the request stays until the rollback is done: `autotune rollback` waits for it to go
        self._note(f"tuning {self.state.study_name} paused: a rollback by hand to entry {to} needs the idle GPUs")
        self._stop_child()
        self._child = None
        self._job = self._pool.submit(self._rollback, to)

    def _rollback(self, to: int) -> Entry | None:
        with PublishLock(self.root):
            return rollback(self.target, self.history, to)

    def _rollback_done(self) -> None:
        job, self._job = self._job, None
        assert job is not None  # called once the rollback's job is done (_tuning)
        try:
            entry = job.result()
            done = (
                f"production is back on entry {entry.source['rollback_to']} (entry {entry.number})"
                if entry is not None
                else "production already ran that config: nothing changed"
            )
            if entry is not None:
                self._told.add(entry.number)
        except AutotuneError as e:
            done = f"the rollback failed: {e}"
        self._history_metrics()
        gpus = self._idle_gpus()
        if gpus and self.state.study_file:
            move_to_gpus(Path(self.state.study_file), gpus)  # the colors may have swapped: staging follows the idle one
        note = f"{done}; tuning {self.state.study_name} resumes" + (f" on GPUs {gpus}" if gpus else "")
        self._note(note, last_decision=note, last_decision_at=time.time())
        self.store.clear_rollback_request()

    # -- approval and publishing -------------------------------------------------------------

    def _awaiting_approval(self) -> None:
        """`autotune publish --approve` leaves the entry it approves in the state directory; the daemon
        publishes it here, on its own loop (publishing, verifying, and a rollback if it fails, as for its
        own winners). `--reject` settles the proposal itself; so does a newer proposal."""
        proposal = self.history.proposal()
        approved = self.store.approval()
        if proposal is None:
            self.store.clear_approval()
            last = self.history.entries()[-1] if self.history.entries() else None
            self._decide(Phase.WATCHING, note=f"proposal settled: {last.outcome if last else 'gone'}")
            return
        if approved is None:
            return
        self.store.clear_approval()
        if approved != proposal.number:
            self._note(f"approval of entry {approved} ignored: the proposal waiting is entry {proposal.number}")
            return
        source = {**proposal.source, "approved": "by hand"}
        self._decide(Phase.PUBLISHING, note=f"publishing entry {proposal.number} (approved by hand)")
        self._job = self._pool.submit(self._publish, proposal.values, source, proposal)

    def canary(self) -> Canary:
        fp = self.fingerprint or (
            Fingerprint.from_json(self.state.tuned_fingerprint) if self.state.tuned_fingerprint else None
        )
        tokenizer = self.study.workload.tokenizer
        assert tokenizer is not None  # the staging study names one: checked when the daemon starts
        return production_canary(self.cfg, self.target, fp, tokenizer)

    def _publish(self, values: dict[str, Any], source: dict[str, Any], entry: Entry | None = None) -> Any:
        what = f"entry {entry.number}" if entry is not None else f"trial {source.get('trial')} of {source.get('study')}"

        def phase(p: str) -> None:
            if p == "verifying":
                self._set(Phase.VERIFYING, note=f"{what} deployed; the canary runs")
            elif p == "rolling_back":
                self._set(Phase.ROLLING_BACK, note=f"{what} failed; putting the last good config back")
            else:  # a blue/green switch's later steps: switching, watching production
                self._note(f"{what}: {p}")

        with PublishLock(self.root):
            return publish(
                self.target,
                values,
                self.history,
                self.canary(),
                source=source,
                entry=entry,
                on_phase=phase,
                verify=switch_verifier(self.cfg, self.target),
            )

    def _publish_done(self) -> None:
        job, self._job = self._job, None
        assert job is not None  # called once the publish's job is done (tick)
        try:
            result = job.result()
        except AutotuneError as e:  # the rollback failed too: say so everywhere, keep watching
            self._decide(Phase.WATCHING, note=f"PRODUCTION NEEDS A PERSON: {e}")
            self._history_metrics()
            self.metrics.last_publish.set(time.time())  # ended now
            return
        self._history_metrics()
        self.metrics.last_publish.set(time.time())  # ended now
        self._decide(
            Phase.WATCHING,
            note=f"entry {result.entry.number}: {result.outcome}"
            + (f" ({result.entry.reason})" if result.entry.reason else ""),
        )

    # -- start-up --------------------------------------------------------------------------------

    def _resume(self) -> None:
        """Pick up what a previous run left: an open publish, a running tuning."""
        if self.state.phase in (Phase.PUBLISHING, Phase.VERIFYING, Phase.ROLLING_BACK):
            # what was in flight settles below; the phase it was in when the daemon died is history
            with self._lock:
                self.state = self.store.save(replace(self.state, phase=Phase.WATCHING, since=time.time()))
        with PublishLock(self.root):
            adopt(self.target, self.history)
            if self.history.open_entry() is not None:
                try:
                    # the canary is built when used: a blue/green switch is re-verified on /metrics instead
                    result = recover(
                        self.target,
                        self.history,
                        lambda url: self.canary()(url),
                        verify=switch_verifier(self.cfg, self.target),
                    )
                except AutotuneError as e:
                    self._decide(
                        Phase.WATCHING,
                        note=f"PRODUCTION NEEDS A PERSON: could not recover the publish a restart cut short: {e}",
                    )
                else:
                    assert result is not None  # an entry was open, and the lock keeps it so
                    self._recovered(result.entry)
        self._history_metrics()

    def _recovered(self, e: Entry) -> None:
        """Say what became of the publish a restart cut short, as the decision it is (``status`` shows it, not the
        "publishing" it replaces). An approved proposal that never reached production is proposed again: its
        approval was for a publish that did not happen, so a person approves it again."""
        said = f"recovered entry {e.number}: {e.outcome}" + (f" ({e.reason})" if e.reason else "")
        if e.outcome == "rolled-back" and not e.reached_production and e.source.get("approved") and self.cfg.approval:
            source = {k: v for k, v in e.source.items() if k != "approved"}
            again = self.history.add("proposed", e.values, source=source)
            self._decide(
                Phase.AWAITING_APPROVAL,
                note=f"{said}; it was approved but never served, so it waits "
                f"for `autotune publish --approve` again as entry {again.number}",
            )
            return
        self._decide(Phase.WATCHING, note=said)

    def _tunings_by_trigger(self) -> dict[str, int]:
        """The state's count of tunings by trigger kind; those a state written before it was kept count as
        "unrecorded", so the total is the state's ``tunings`` either way."""
        counts = dict(self.state.tunings_by_trigger)
        rest = self.state.tunings - sum(counts.values())
        if rest > 0:
            counts["unrecorded"] = counts.get("unrecorded", 0) + rest
        return counts

    def _history_metrics(self, entries: list[Entry] | None = None) -> None:
        """Publish and rollback metrics from the history (``entries``: as this tick read it; None: read it now):
        restored after a restart, and counting the rollbacks `autotune rollback` made from another process;
        production's capacity with them (``_production_capacity``)."""
        if entries is None:
            entries = self._entries()
        if entries is None:  # a damaged entry: the history's own commands say which; metrics wait
            return
        self.metrics.from_history(entries)
        cap = self._production_capacity(entries)
        if cap is not None:
            self.metrics.production_capacity.set(cap)

    def _production_capacity(self, entries: list[Entry]) -> float | None:
        """Production's config's capacity on staging, from the state directory alone (so a restart keeps it).

        The config production runs is the newest adopted or published entry, or, after a rollback by hand,
        the entry it went back to. If that entry predates the last finished tuning, the tuning measured it
        as its `production` baseline: that measurement. If it came later (the tuning's own winner, or a
        publish by hand), what its source says the tuning that found it measured. None: unknown (the gauge
        keeps what it had).
        """
        good = [e for e in entries if e.outcome in ("adopted", "published")]
        if not good:
            return None
        by_number, prod, seen = {e.number: e for e in entries}, good[-1], set()
        while "rollback_to" in prod.source and prod.number not in seen:  # by hand: the config it restored
            seen.add(prod.number)
            back = by_number.get(prod.source["rollback_to"])
            if back is None:
                return None
            prod = back
        st = self.state
        started = st.tuning_started or st.last_tuning_end  # a state file from before tuning_started: its end
        # the tuning's `production` baseline ran the config production had when it started (production_values;
        # a state file from before that field: any entry older than the tuning), not one rolled back to meanwhile
        measured_by_it = (
            same_config(prod.values, st.production_values) if st.production_values is not None else prod.time < started
        )
        if st.study_name and st.last_tuning_end and measured_by_it and st.phase is not Phase.TUNING:
            if st.study_name not in self._capacities:  # a finished study does not change: read it once
                result = self._tuning_result(st.study_name)
                self._capacities[st.study_name] = production_capacity(result) if result is not None else None
            return self._capacities[st.study_name]
        cap = prod.source.get("capacity_rps")
        return float(cap) if isinstance(cap, (int, float)) else None
