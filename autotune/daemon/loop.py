"""The daemon: watch production, re-tune on staging when its traffic drifts, publish safely.

One thread ticks every scrape interval: it pings systemd's watchdog, scrapes production,
updates the metrics, and advances the state machine (state.py). Long work never runs on it:

- a tuning is a child process, ``autotune study`` on a generated study file (the staging
  study, with production's traffic as its workload, production's config as a baseline, and
  the winners of earlier tunings as warm-start baselines). Optuna's storage keeps every trial,
  so a daemon restart resumes the same study; stopping the daemon interrupts the child, which
  stops its staging engine (and leftover records reap it should the daemon die with -9);
- a publish is a transaction (publish.transaction) on a worker thread; the tick only follows
  its phase and keeps the watchdog fed through a 15-minute health wait.

Everything needed to resume is in the state file and the publish history under the state
directory ($STATE_DIRECTORY under systemd).
"""

from __future__ import annotations

import concurrent.futures
import datetime as dt
from dataclasses import replace
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import optuna
import tomli_w

from autotune.daemon import notify
from autotune.daemon.config import DaemonConfig
from autotune.daemon.exporter import DaemonMetrics
from autotune.daemon.state import Observation, Phase, StateStore, decide
from autotune.daemon.watcher import Fingerprint, Watcher, drift, workload_from
from autotune.engine.kind import get_kind
from autotune.errors import AutotuneError, ConfigError
from autotune.locations import atomic_write, state_dir
from autotune.publish.canary import replay_canary
from autotune.publish.history import History
from autotune.publish.transaction import Target, adopt, publish, recover
from autotune.study.definition import load_study
from autotune.study.runner import build_space, constraints_of, remeasured_winner
from autotune.workload.prompts import PromptBuilder, load_tokenizer, materialize
from autotune.measure.replay import ReplayOptions
from autotune.workload.trace import write_trace

__all__ = ["Daemon", "build_target", "daemon_root"]

MIN_REQUESTS = 20  # a window with fewer finished requests says too little about the traffic
TUNING_REQUESTS = 400  # requests in a re-tuning study's synthesized trace


def daemon_root(cfg: DaemonConfig) -> Path:
    return state_dir() / "daemon" / cfg.name


def build_target(cfg: DaemonConfig) -> Target:
    p = cfg.production
    if p.kind == "xinference":
        from autotune.publish.xinference import target_from_config

        return target_from_config(p.url, p.xinference)
    from autotune.publish.vllm_config import VllmConfigTarget

    assert p.config is not None
    return VllmConfigTarget(p.config, p.model, p.restart, p.url, get_kind("vllm").flag_table(["vllm"]),
                            health_timeout_s=p.health_timeout_s, restart_timeout_s=p.health_timeout_s + 120)


class Daemon:
    def __init__(self, cfg: DaemonConfig, *, target: Target | None = None, root: Path | None = None,
                 metrics: DaemonMetrics | None = None, autotune_argv: list[str] | None = None) -> None:
        self.cfg = cfg
        self.root = root or daemon_root(cfg)
        self.store = StateStore(self.root)
        self.history = History(self.root / "history")
        self.target = target or build_target(cfg)
        self.metrics = metrics or DaemonMetrics()
        self.watcher = Watcher(cfg.production.url, window_s=cfg.window_s)
        self.study = load_study(cfg.staging_study)  # the template: checked now, not at the first drift
        if self.study.workload.tokenizer is None:
            raise ConfigError(f"{cfg.staging_study}: the daemon builds prompts like production's with the model's "
                              "tokenizer: set [workload].tokenizer (or engine.args.tokenizer) to a local directory")
        self.autotune = autotune_argv or [sys.executable, "-m", "autotune"]
        self.state = self.store.load()
        self.fingerprint: Fingerprint | None = None
        self._lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish")
        self._job: concurrent.futures.Future[Any] | None = None

    # -- the loop ------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> int:
        if self.cfg.metrics_listen:
            self.metrics.serve(*self.cfg.metrics_listen)
        self._resume()
        notify.ready()
        # systemd restarts a daemon that stays silent for WatchdogSec: tick at least twice as often
        wd = notify.watchdog_interval()
        interval = min(self.cfg.scrape_interval_s, wd / 2) if wd else self.cfg.scrape_interval_s
        try:
            while not stop.is_set():
                self.tick()
                stop.wait(interval)
        finally:
            notify.stopping()
            self._stop_child()
            self._pool.shutdown(wait=True)  # a publish in flight finishes: never leave production half-done
            self.watcher.close()
        return 0

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
        self.metrics.set_phase(self.state.phase.value)
        notify.status(f"{self.state.phase.value}: {self.state.note}"[:200])

    def _set(self, phase: Phase, **changes: Any) -> None:
        with self._lock:
            self.state = self.store.save(self.state.to(phase, **changes))

    def _note(self, text: str, **changes: Any) -> None:
        with self._lock:
            self.state = self.store.save(replace(self.state, note=text, **changes))

    # -- watching ------------------------------------------------------------------------------

    def _observe(self) -> Observation | None:
        window = self.watcher.poll()
        if window is None:
            if self.watcher.consecutive_errors:
                self.metrics.scrape_errors.inc()
            return None
        compliance = window.slo_compliance(self.cfg.slos)
        self.metrics.set_slos(compliance)
        if window.request_rate is not None:
            self.metrics.request_rate.set(window.request_rate)
        if window.requests < MIN_REQUESTS or window.dt < 0.5 * self.cfg.window_s:
            return Observation(None, None)
        fp = Fingerprint.of(window)
        self.fingerprint = fp
        if self.state.tuned_fingerprint is None:  # the traffic production's config is judged against from now on
            self._note("first full window: traffic fingerprint recorded", tuned_fingerprint=fp.to_json())
        score = drift(Fingerprint.from_json(self.state.tuned_fingerprint), fp)
        self.metrics.drift.set(score)
        # only latency SLOs judge production: its throughput is what users sent, not what it can do
        known = [e.holds for e in compliance if e.holds is not None and e.slo.is_latency]
        return Observation(score, (not all(known)) if known else None)

    def _watching(self, obs: Observation | None) -> None:
        now = time.time()
        t = self.cfg.triggers
        d = decide(self.state, obs, now=now, drift_threshold=t.drift, breach_windows=t.breach_windows,
                   every_s=t.every_s, cooldown_s=t.cooldown_s, in_window=self.cfg.may_tune_at(dt.datetime.now()),
                   manual=self.store.take_retune_request())
        if d.trigger is None:
            self._note(d.waiting or "watching", breach_streak=d.breach_streak)
            return
        if self.fingerprint is None:
            self._note(f"{d.trigger}; waiting for a full window of traffic to imitate", breach_streak=d.breach_streak)
            if d.trigger.startswith("requested"):
                self.store.request_retune(d.trigger[len("requested: "):])  # keep the request
            return
        self._start_tuning(d.trigger, self.fingerprint)

    # -- tuning --------------------------------------------------------------------------------

    def _start_tuning(self, trigger: str, fp: Fingerprint) -> None:
        n = self.state.tunings + 1
        name = f"{self.cfg.name}-tune-{n:03d}"
        path = self.root / "tunings" / f"{name}.toml"
        self._write_tuning_study(name, path, fp)
        self.metrics.tunings.labels(trigger.split(":")[0].split(" ")[0]).inc()
        self._set(Phase.TUNING, trigger=trigger, study_name=name, study_file=str(path), tunings=n,
                  note=f"tuning {name}: {trigger}", tuned_fingerprint=self.state.tuned_fingerprint,
                  breach_streak=0)
        self._spawn()

    def _write_tuning_study(self, name: str, path: Path, fp: Fingerprint) -> None:
        """The staging study with production's traffic as its workload and production's config as a baseline."""
        import tomllib

        data = tomllib.loads(self.cfg.staging_study.read_text())
        d = self.study
        mml = d.fixed.values.get("max_model_len")
        workload = workload_from(fp, requests=TUNING_REQUESTS, seed=self.state.tunings,
                                 max_model_len=int(mml) if mml else None, name=name)
        path.parent.mkdir(parents=True, exist_ok=True)
        if self.cfg.staging_trace is not None:  # production's own requests, recorded by autotune capture
            trace = self.cfg.staging_trace
        else:
            trace = path.with_suffix(".jsonl")
            write_trace(materialize(workload, PromptBuilder(load_tokenizer(d.workload.tokenizer)), seed=0), trace)
        data["name"] = name
        data["storage"] = d.storage
        data["runs_dir"] = str(d.runs_dir.resolve())
        data["slos"] = [s.text for s in self.cfg.slos]
        wl = {"trace": str(trace.resolve())}
        if d.workload.tokenizer is not None:
            wl["tokenizer"] = str(Path(d.workload.tokenizer).resolve())
        data["workload"] = wl
        data.setdefault("objective", {}).setdefault("step_duration", f"{max(workload.span_s / 2, 10):.0f}s")
        names = set(build_space(d).names())
        baselines = data.setdefault("baselines", {})
        deployed = self.target.deployed() or {}
        production = {k: v for k, v in deployed.items() if k in names}
        if production:
            baselines["production"] = production
        extra = [b for b in baselines.get("extra", []) if not str(b.get("name", "")).startswith("earlier-")]
        for i, values in enumerate(self._earlier_winners(names)):
            extra.append({"name": f"earlier-{i + 1}", "values": values})
        baselines["extra"] = extra
        atomic_write(path, tomli_w.dumps(data))

    def _earlier_winners(self, names: set[str], top: int = 3) -> list[dict[str, Any]]:
        """Warm start: the best feasible trials of this daemon's earlier tunings."""
        out: list[tuple[float, dict[str, Any]]] = []
        prefix = f"{self.cfg.name}-tune-"
        try:
            summaries = optuna.get_all_study_summaries(self.study.storage)
        except Exception:  # no storage yet
            return []
        for s in summaries:
            if not s.study_name.startswith(prefix):
                continue
            study = optuna.load_study(study_name=s.study_name, storage=self.study.storage)
            for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
                if all(c <= 0 for c in constraints_of(t)) and t.values and t.values[0] > 0:
                    out.append((t.values[0], {k: v for k, v in t.params.items() if k in names}))
        out.sort(key=lambda x: -x[0])
        seen: list[dict[str, Any]] = []
        for _, values in out:
            if values not in seen:
                seen.append(values)
            if len(seen) == top:
                break
        return seen

    def _spawn(self) -> None:
        st = self.state
        log = open(self.root / "tunings" / f"{st.study_name}.log", "ab")
        argv = [*self.autotune, "study", str(st.study_file)]
        # own process group: stopping the daemon interrupts the study (SIGINT), which stops its engine
        self._child = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()

    def _tuning(self) -> None:
        if self._child is None:
            self._spawn()  # the daemon restarted mid-tuning: the study resumes from its storage
            return
        self._update_trials()
        rc = self._child.poll()
        if rc is None:
            return
        self._child = None
        self._finish_tuning(rc)

    def _update_trials(self) -> None:
        try:
            study = optuna.load_study(study_name=self.state.study_name, storage=self.study.storage)
        except Exception:
            return
        counts: dict[str, int] = {}
        for t in study.get_trials(deepcopy=False):
            counts[t.state.name.lower()] = counts.get(t.state.name.lower(), 0) + 1
        self.metrics.set_trials(counts)

    def _finish_tuning(self, rc: int) -> None:
        st = self.state
        done = dict(last_tuning_end=time.time(), tuned_fingerprint=self.fingerprint.to_json()
                    if self.fingerprint else st.tuned_fingerprint)
        if rc not in (0, 1):
            self._set(Phase.WATCHING, note=f"tuning {st.study_name} failed (exit {rc}); see its log", **done)
            return
        study = optuna.load_study(study_name=st.study_name, storage=self.study.storage)
        self._update_trials()
        verdict = remeasured_winner(study)
        if rc == 1 or verdict is None:
            self._set(Phase.WATCHING, note=f"tuning {st.study_name}: no config met the SLOs", **done)
            return
        winner = study.trials[verdict["winner_trial"]]
        self.metrics.best_capacity.set(float(winner.user_attrs.get("capacity_rps", 0.0)))
        better, why = _beats_production(study, verdict)
        if not better:
            self._set(Phase.WATCHING, note=f"tuning {st.study_name}: production's config stays ({why})", **done)
            return
        values = dict(winner.user_attrs["engine_args"]["values"])
        source = {"study": st.study_name, "trial": winner.number, "trigger": st.trigger,
                  "capacity_rps": winner.user_attrs.get("capacity_rps"), "why": why}
        if self.cfg.approval:
            for old in [e for e in self.history.entries() if e.outcome == "proposed"]:
                self.history.settle(old, "rejected", reason="replaced by a newer proposal")
            e = self.history.add("proposed", values, source=source)
            self._set(Phase.AWAITING_APPROVAL, note=f"entry {e.number} waits for `autotune publish --approve`",
                      **done)
            return
        self._set(Phase.PUBLISHING, note=f"publishing trial {winner.number} of {st.study_name}", **done)
        self._job = self._pool.submit(self._publish, values, source)

    def _stop_child(self) -> None:
        if self._child is None or self._child.poll() is not None:
            return
        try:
            os.killpg(self._child.pid, signal.SIGINT)  # the study stops its engine and stays resumable
            self._child.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self._child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # -- approval and publishing -------------------------------------------------------------

    def _awaiting_approval(self) -> None:
        # `autotune publish --approve` publishes (under the same lock) and settles the entry
        if self.history.proposal() is None:
            last = self.history.entries()[-1] if self.history.entries() else None
            self._set(Phase.WATCHING, note=f"proposal settled: {last.outcome if last else 'gone'}")

    def canary(self):
        fp = self.fingerprint or (Fingerprint.from_json(self.state.tuned_fingerprint)
                                  if self.state.tuned_fingerprint else None)
        if fp is None:
            raise AutotuneError("no traffic fingerprint yet: nothing to build a canary from")
        # Xinference: chat (its Transformers engine cannot stream completions), its model uid, its token
        xinference = self.cfg.production.kind == "xinference"
        w = workload_from(fp, requests=self.cfg.canary_requests, seed=int(time.time()) % 1000, name="canary",
                          api="chat" if xinference else "completion")
        w = materialize(w, PromptBuilder(load_tokenizer(self.study.workload.tokenizer)), seed=1)
        options = ReplayOptions(warmup_requests=0)
        if xinference:
            options = ReplayOptions(warmup_requests=0, api_key=self.target.api_key(), model=self.target.model_uid)
        return replay_canary(w, self.cfg.slos, options)

    def _publish(self, values: dict[str, Any], source: dict[str, Any]) -> Any:
        def phase(p: str) -> None:
            self._set(Phase(p))

        with publish_lock(self.root):
            return publish(self.target, values, self.history, self.canary(), source=source, on_phase=phase)

    def _publish_done(self) -> None:
        job, self._job = self._job, None
        try:
            result = job.result()
        except AutotuneError as e:  # the rollback failed too: say so everywhere, keep watching
            self.metrics.published("rollback-failed", time.time())
            self._set(Phase.WATCHING, note=f"PRODUCTION NEEDS A PERSON: {e}")
            return
        self.metrics.published(result.outcome, time.time())
        if result.ok:
            self.metrics.set_production(result.entry.number, result.entry.values)
        self._set(Phase.WATCHING, note=f"entry {result.entry.number}: {result.outcome}"
                  + (f" ({result.entry.reason})" if result.entry.reason else ""))

    # -- start-up --------------------------------------------------------------------------------

    def _resume(self) -> None:
        """Pick up what a previous run left: an open publish, a running tuning."""
        with publish_lock(self.root):
            adopt(self.target, self.history)
            if self.history.open_entry() is not None:
                try:
                    result = recover(self.target, self.history, self.canary())
                    self._note(f"recovered entry {result.entry.number}: {result.outcome}")
                except AutotuneError as e:
                    self._note(f"could not recover the open publish: {e}")
        if self.state.phase in (Phase.PUBLISHING, Phase.VERIFYING, Phase.ROLLING_BACK):
            # the transaction settled above; the phase it was in when the daemon died is history
            with self._lock:
                self.state = self.store.save(replace(self.state, phase=Phase.WATCHING, since=time.time()))
        good = self.history.last_good()
        if good is not None:
            self.metrics.set_production(good.number, good.values)


def _beats_production(study: optuna.Study, verdict: dict[str, Any]) -> tuple[bool, str]:
    """Is the re-measured winner better than production's config by more than the noise?

    The study's own verdict compares the winner with the best *baseline*; what matters here is
    production's config (the "production" baseline): re-measured if it was the best baseline,
    else its one measurement. Without it, the study's verdict decides.
    """
    win = next(c for c in verdict["candidates"] if c["trial"] == verdict["winner_trial"])
    prod = next((t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("baseline") == "production"), None)
    if prod is None:
        return verdict["significant"], f"{verdict['winner']} vs {verdict['baseline']}: {verdict['gain_rps']:+.2f} req/s"
    if win["trial"] == prod.number:
        return False, "production's own config won"
    remeasured = next((c for c in verdict["candidates"] if c["trial"] == prod.number), None)
    prod_cap = remeasured["median"] if remeasured else float(prod.user_attrs.get("capacity_rps", 0.0))
    gain = win["median"] - prod_cap
    why = (f"{verdict['winner']} {win['median']:.2f} req/s vs production {prod_cap:.2f}: {gain:+.2f}, "
           f"noise {verdict['noise_rps']:.2f}")
    return gain > verdict["noise_rps"], why


class publish_lock:
    """One publish at a time per daemon: the daemon's own and `autotune publish --approve`/`rollback`."""

    def __init__(self, root: Path) -> None:
        self.path = Path(root) / "publish.lock"

    def __enter__(self) -> publish_lock:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "w")
        fcntl.flock(self._f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        import fcntl

        fcntl.flock(self._f, fcntl.LOCK_UN)
        self._f.close()
