"""Where a study lives: its Optuna storage (SQLite on one host, a shared database for several), sampler and pruner.

Constraints are stored the legacy way (the sampler's ``constraints_func`` writes them to the trial's system
attrs), which is what optuna-dashboard 0.21 shows.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import optuna

from autotune.errors import ConfigError
from autotune.study.definition import StudyDefinition
from autotune.study.records import constraints_of

__all__ = ["open_study", "make_sampler", "shared_storage", "storage_of", "TPE_STARTUP_TRIALS"]

TPE_STARTUP_TRIALS = 5  # finished trials (baselines included) before TPE models the space; random until then


def make_sampler(kind: str, seed: int | None) -> optuna.samplers.BaseSampler:
    # constraints_func is deprecated in Optuna 5 in favour of trial.set_constraint, but optuna-dashboard
    # 0.21 shows only constraints written this way; group=True is "experimental" and is what lets
    # multivariate TPE handle conditional parameters. Both on purpose: silence their warnings.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if kind == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        if kind == "gp":
            return optuna.samplers.GPSampler(seed=seed, constraints_func=constraints_of)
        # n_ei_candidates 128 (Optuna's default is 24): an ask costs milliseconds more, a trial minutes, so a
        # better-chosen trial is worth far more than the ask's time
        return optuna.samplers.TPESampler(
            seed=seed,
            multivariate=True,
            group=True,
            constant_liar=True,
            constraints_func=constraints_of,
            n_startup_trials=TPE_STARTUP_TRIALS,
            n_ei_candidates=128,
        )


def shared_storage(d: StudyDefinition) -> bool:
    """A server database (PostgreSQL, MySQL) that workers on several hosts may share; SQLite is one host's."""
    return not d.storage.startswith("sqlite:")


def storage_of(d: StudyDefinition) -> str | optuna.storages.BaseStorage:
    """On a shared database every worker heartbeats its running trial: a trial whose worker died
    (host lost, killed -9) goes stale after the grace period, is failed by the next worker that
    looks, and retried once on another host with the same params."""
    if not shared_storage(d):
        db = Path(d.storage[len("sqlite:///") :].partition("?")[0])
        db.parent.mkdir(parents=True, exist_ok=True)
        _owner_only(db)
        return d.storage
    import sqlalchemy.exc

    def connect() -> optuna.storages.RDBStorage:
        with warnings.catch_warnings():  # heartbeats are "experimental" in Optuna 5, and what several hosts need
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.storages.RDBStorage(
                d.storage,
                heartbeat_interval=max(1, int(d.heartbeat_s)),
                grace_period=max(2, int(3 * d.heartbeat_s)),
                heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1),
            )

    for delay in (0.5, 1.0, 2.0, 4.0):
        try:
            return connect()
        except sqlalchemy.exc.IntegrityError:  # hosts starting together race to create Optuna's schema
            time.sleep(delay)
    return connect()


def _owner_only(db: Path) -> None:
    """The study database (every trial's config, failure texts) is 0600: created so before Optuna opens
    it (SQLite gives its journal the database's mode), and one an earlier autotune made 0644 is fixed."""
    if db.name in ("", ":memory:"):
        return
    if not db.exists():
        os.close(os.open(db, os.O_WRONLY | os.O_CREAT, 0o600))
    if db.stat().st_uid == os.getuid():  # another user's database is its owner's to protect
        os.chmod(db, 0o600)


def open_study(d: StudyDefinition) -> optuna.Study:
    """The study's Optuna study, created or loaded; one stored with other directions is refused."""
    scoring = d.objective.scoring()
    directions = [
        optuna.study.StudyDirection.MAXIMIZE if x == "maximize" else optuna.study.StudyDirection.MINIMIZE
        for x in scoring.directions
    ]
    pruner = (
        optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=1)
        if scoring.prunable
        else optuna.pruners.NopPruner()
    )
    study = optuna.create_study(
        study_name=d.name,
        storage=storage_of(d),
        sampler=make_sampler(d.sampler, d.seed),
        directions=directions,
        pruner=pruner,
        load_if_exists=True,
    )
    if study.directions != directions:
        raise ConfigError(f"study {d.name!r} in {d.storage} was made with another objective; use another --study-name")
    return study
