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

import datetime as dt
import re
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from autotune.daemon import notify
from autotune.daemon.arrivals import ArrivalLog
from autotune.daemon.config import DaemonConfig, load_daemon_config
from autotune.daemon.exporter import DaemonMetrics
from autotune.daemon.fingerprint import Fingerprint, drift
from autotune.daemon.phase import ResultReader, say
from autotune.daemon.production import build_target, daemon_root
from autotune.daemon.publishing import Publishing
from autotune.daemon.state import DaemonState, Observation, Phase, StateStore, decide
from autotune.daemon.tuning import load_staging, production_capacity
from autotune.daemon.tuning_phase import TuningPhase
from autotune.daemon.watcher import Watcher
from autotune.daemon.window import moved_from
from autotune.engine.health import probe
from autotune.errors import AutotuneError
from autotune.publish.history import Entry, History
from autotune.publish.target import Target
from autotune.publish.transaction import PublishLock, adopt, same_config
from autotune.study.records import StudyResult

__all__ = ["Daemon"]

MIN_REQUESTS = 20  # a window with fewer finished requests says too little about the traffic
LEVEL_SPAN = 2  # scrape intervals: a new level of the traffic counts once it has lasted this long
FULL_WINDOW = 0.98  # of window_s: a window is judged once it spans that much (ticks land a little early or late)


def _shape(note: str) -> str:
    """A note without its numbers: what stays the same while a wait counts down."""
    return re.sub(r"\d+(\.\d+)?", "#", note)


class Daemon:
    """The loop: ticks, watching production, the state and its journal; the tuning and publishing phases
    (tuning_phase.py, publishing.py) own their transitions and call back ``enter``, ``decided``, ``note`` and
    ``keep`` to make them."""

    def __init__(
        self,
        cfg: DaemonConfig,
        *,
        target: Target | None = None,
        root: Path | None = None,
        metrics: DaemonMetrics | None = None,
        autotune_argv: list[str] | None = None,
        read_result: ResultReader = StudyResult.load,
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
        self.read_result = read_result
        self.state = self.store.load()
        self.fingerprint: Fingerprint | None = None
        self._lock = threading.Lock()
        self.publishing = Publishing(self)
        self.tuning = TuningPhase(self, self.publishing)
        self._failed_scrapes = 0  # in the current streak
        self._capacities: dict[str, float | None] = {}  # a finished tuning's measurement of production, by study
        self._settled = self._last_settled()  # the last publish or rollback the watcher's window starts after

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
            self.tuning.stop()
            self.publishing.shutdown()
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
            say(f"reload: {path} not applied, the running config stays: {e}")
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
        if new.production != self.cfg.production and self.publishing.job is None:
            self.target = build_target(new)
        if new.arrivals_log != self.cfg.arrivals_log:  # new totals: no window may span the old reader's and the new
            if self.watcher.arrivals is not None:
                self.watcher.arrivals.close()
            self.watcher.arrivals = ArrivalLog(new.arrivals_log) if new.arrivals_log else None
            self.watcher.restart_window()
        self.cfg, self.study = new, study
        self.watcher.window_s = new.window_s
        say(f"reloaded {path}" + (f"; {', '.join(held)} changed and take a restart" if held else ""))

    def tick(self) -> None:
        notify.watchdog()
        obs = self._observe()
        phase = self.state.phase
        if phase is Phase.WATCHING:
            self._watching(obs)
        elif phase is Phase.TUNING:
            self.tuning.step()
        elif phase is Phase.AWAITING_APPROVAL:
            self.publishing.awaiting_approval()
        elif self.publishing.job is not None and self.publishing.job.done():
            self.publishing.done()
        entries = self._entries()  # once per tick, after the phase's own step: what it settled counts now
        self._after_publishes(entries)
        self.metrics.set_phase(self.state.phase.value)
        self.metrics.set_tunings(self._tunings_by_trigger())
        self.history_metrics(entries)
        notify.status(f"{self.state.phase.value}: {self.state.note}"[:200])

    def enter(self, phase: Phase, **changes: Any) -> None:
        with self._lock:
            before = self.state
            self.state = self.store.save(self.state.to(phase, **changes))
        self._journal(before)

    def decided(self, phase: Phase, note: str, **changes: Any) -> None:
        """A phase change that is a decision (a tuning's verdict, a publish or a proposal, its outcome): its note
        is kept as the last decision too, which `autotune status` shows once later notes ("watching") replaced it."""
        self.enter(phase, note=note, last_decision=note, last_decision_at=time.time(), **changes)

    def note(self, text: str, **changes: Any) -> None:
        self.keep(note=text, **changes)

    def keep(self, **changes: Any) -> None:
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
        if (
            "rollback_to" in last.source and last.number not in self.publishing.told
        ):  # `autotune rollback` elsewhere: said too
            self.decided(
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
        fp = Fingerprint.of(window, self.watcher.since_change(LEVEL_SPAN * self.cfg.scrape_interval_s))
        self.fingerprint = fp
        if self.state.tuned_fingerprint is None:  # the traffic production's config is judged against from now on
            self.note("first full window: traffic fingerprint recorded", tuned_fingerprint=fp.to_json())
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
                say(
                    f"cannot scrape production ({where}): {w.last_error}{self._serving_engine_down()}; retrying "
                    f"every {self.cfg.scrape_interval_s:g} s, quiet until it works again"
                )
            error = f"{where}: {w.last_error}"
            if not self.state.scrape_failing or self.state.scrape_error != error:
                self.keep(scrape_error=error, scrape_error_at=time.time(), scrape_failing=True)
        elif self.state.scrape_failing:
            n, self._failed_scrapes = self._failed_scrapes, 0
            say(f"scraping production works again ({where})" + (f" after {n} failed scrapes" if n else ""))
            self.keep(scrape_failing=False)

    def _serving_engine_down(self) -> str:
        """Behind a proxy: whether the color it serves through answers /health itself, said as part of the
        scrape's journal line ("" when it does, or when production is no blue/green pair)."""
        live = getattr(self.target, "live", None)
        if live is None or self.publishing.job is not None:  # a publish in flight moves colors on purpose
            return ""
        try:
            color = live()
        except AutotuneError:
            return ""  # the proxy's file names no color: the publish commands say what to write
        h = probe(color.url, timeout=2.0)
        if h.ok:
            return ""
        return (
            f"; {color.name} ({color.url}), the color serving users, does not answer /health either "
            f"({h.said}): its engine crashed or is restarting (vllm@.service's Restart=on-failure "
            "starts it again from its YAML)"
        )

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
            # a failing scrape is its own journal line (_scrape_news) and `autotune status` line: not this note's
            self.note(d.waiting or "watching", breach_streak=d.breach_streak)
            return
        if self.fingerprint is None:
            self.note(f"{d.trigger}; waiting for a full window of traffic to imitate", breach_streak=d.breach_streak)
            return
        # the newest scrape interval against the rate to imitate: early in a change of level, the window (and a
        # split of it that must span LEVEL_SPAN intervals) is a blend of two levels, the newest interval is not
        span = self.cfg.scrape_interval_s
        recent, rate = self.watcher.recent(span), self.fingerprint.request_rate
        if recent is not None and rate and moved_from(recent, rate):
            # whichever trigger fires first, a tuning imitates the traffic's level, never a blend of two levels
            self.note(
                f"{d.trigger}; the traffic is changing level (its last {span:g} s arrived at "
                f"{recent.arrival_rate or 0:.2f} req/s, its window at {rate:.2f}): waiting for it to settle",
                breach_streak=d.breach_streak,
            )
            return
        if manual is not None:
            self.store.clear_retune_request()  # taken: this tuning is the one it asked for
        self.tuning.start(d.trigger, self.fingerprint)

    # -- start-up --------------------------------------------------------------------------------

    def _resume(self) -> None:
        """Pick up what a previous run left: an open publish, a running tuning."""
        if self.state.phase in (Phase.PUBLISHING, Phase.VERIFYING, Phase.ROLLING_BACK):
            # what was in flight settles below; the phase it was in when the daemon died is history
            with self._lock:
                self.state = self.store.save(replace(self.state, phase=Phase.WATCHING, since=time.time()))
        with PublishLock(self.root):
            adopt(self.target, self.history)
            self.publishing.recover_open()
        self.history_metrics()

    def _tunings_by_trigger(self) -> dict[str, int]:
        """The state's count of tunings by trigger kind; those a state written before it was kept count as
        "unrecorded", so the total is the state's ``tunings`` either way."""
        counts = dict(self.state.tunings_by_trigger)
        rest = self.state.tunings - sum(counts.values())
        if rest > 0:
            counts["unrecorded"] = counts.get("unrecorded", 0) + rest
        return counts

    def history_metrics(self, entries: list[Entry] | None = None) -> None:
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
                result = self.tuning.result(st.study_name)
                self._capacities[st.study_name] = production_capacity(result) if result is not None else None
            return self._capacities[st.study_name]
        cap = prod.source.get("capacity_rps")
        return float(cap) if isinstance(cap, (int, float)) else None
