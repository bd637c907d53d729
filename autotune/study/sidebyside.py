"""Trials side by side: up to ``jobs`` of a study's trials at once, each measured in a thread of its own (on its own
GPUs: study/slots.py), told to Optuna as ``Study.optimize`` tells them.

One thread asks Optuna for every trial, one at a time. Optuna's own ``n_jobs`` asks in each thread, and on SQLite
two threads can pop the same enqueued trial (a baseline measured twice, then told twice). A trial is told when
its objective ends, and the study's callbacks (the console's line, what the simulator learns) run under the
study's lock, as everything but the measurement does inside the objective (study/runner.py). A benchmark in
virtual time calls ``measure_trial`` when a trial starts and ``end_trial`` when its GPU time has passed
(scripts/bench_parallel.py).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Protocol

import optuna
from optuna.storages._heartbeat import get_heartbeat_thread, is_heartbeat_enabled  # what optimize() uses
from optuna.trial import FrozenTrial, TrialState

from autotune.errors import TrialFailed

__all__ = ["TrialEnd", "Trials", "measure_trial", "end_trial", "side_by_side_trials"]

Callbacks = list[Callable[[optuna.Study, FrozenTrial], None]]


@dataclass(frozen=True)
class TrialEnd:
    """How a trial's objective ended: Optuna's state for it (None: COMPLETE with ``value``), and what it raised that
    stops the study."""

    state: TrialState | None
    value: float | tuple[float, ...] | None = None
    raised: BaseException | None = None


class Trials(Protocol):
    """What runs the trials (study/runner.py's StudyRun)."""

    lock: threading.RLock
    notice: Callable[[str], None]

    def objective(self, trial: optuna.Trial) -> float | tuple[float, ...]: ...

    def remaining(self, study: optuna.Study) -> int | None: ...


def measure_trial(run: Trials, trial: optuna.Trial) -> TrialEnd:
    """The trial's objective, and what Optuna is to be told of it."""
    try:
        return TrialEnd(None, run.objective(trial))
    except optuna.TrialPruned:
        return TrialEnd(TrialState.PRUNED)
    except TrialFailed as e:  # not the config's fault: FAIL, and the study goes on
        run.notice(f"trial {trial.number} failed: {e}")
        return TrialEnd(TrialState.FAIL)
    except BaseException as e:  # noqa: BLE001 - Interrupted, a bug, a bad space: FAIL, re-raised by end_trial
        return TrialEnd(TrialState.FAIL, raised=e)


def end_trial(run: Trials, study: optuna.Study, trial: optuna.Trial, end: TrialEnd, callbacks: Callbacks) -> None:
    """Tell Optuna, raise what stops the study, else run the callbacks."""
    frozen = study.tell(trial, end.value if end.state is None else None, state=end.state, skip_if_finished=True)
    if end.raised is not None:
        raise end.raised
    with run.lock:
        for callback in callbacks:
            callback(study, frozen)


def side_by_side_trials(
    run: Trials, study: optuna.Study, n: int | None, jobs: int, timeout_s: float | None, callbacks: Callbacks
) -> None:
    """Up to ``jobs`` trials at once until ``n`` are asked, the study's budget is spent (trials running count) or
    ``timeout_s`` passed; then wait for those running. What a trial raised that is no verdict on its config stops
    the study once the trials beside it end."""
    deadline = time.monotonic() + timeout_s if timeout_s else math.inf
    heartbeat = is_heartbeat_enabled(study._storage)
    running: set[Future[None]] = set()
    asked = 0
    with ThreadPoolExecutor(jobs, thread_name_prefix="trial") as pool:
        while True:
            for f in [f for f in running if f.done()]:
                running.discard(f)
                f.result()
            left = run.remaining(study)
            spent = left is not None and left <= len(running)
            if (n is not None and asked >= n) or spent or time.monotonic() >= deadline:
                break
            if len(running) >= jobs:
                wait(running, timeout=0.25, return_when=FIRST_COMPLETED)
                continue
            if heartbeat:
                optuna.storages.fail_stale_trials(study)
            with run.lock:
                trial = study.ask()
            asked += 1
            running.add(pool.submit(_in_thread, run, study, trial, callbacks))
        for f in running:
            f.result()


def _in_thread(run: Trials, study: optuna.Study, trial: optuna.Trial, callbacks: Callbacks) -> None:
    with get_heartbeat_thread(trial._trial_id, study._storage):
        end = measure_trial(run, trial)
    end_trial(run, study, trial, end, callbacks)
