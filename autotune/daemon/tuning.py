"""A re-tuning: the study file it runs, the child process that runs it, and what its verdict means.

A tuning is ``autotune study`` in a child process on a study derived from the staging study
(study.definition.derive_study): production's traffic as its workload, production's config and
the winners of earlier tunings as baselines (``warm_starts``: never one the study measures anyway,
at most a third of the budget). Whether production gets the result is ``choose``'s call: a
significant gain over production's config, never a tie. Optuna's storage keeps every trial, so a daemon
restart resumes the same study; stopping the daemon interrupts the child (SIGINT), which stops
its staging engine and leaves the study resumable.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from autotune.daemon.fingerprint import Fingerprint, workload_from
from autotune.errors import ConfigError
from autotune.study.baselines import baseline_points
from autotune.study.definition import StudyDefinition, derive_study, load_study
from autotune.study.posterior import Posterior
from autotune.study.records import Attr, StudyResult, TrialRecord, step_share
from autotune.study.runner import build_space
from autotune.study.scoring import CONFIDENCE
from autotune.workload.prompts import PromptBuilder, load_tokenizer, materialize
from autotune.workload.trace import write_trace

__all__ = [
    "TUNING_REQUESTS",
    "MIN_GAIN",
    "Choice",
    "load_staging",
    "write_tuning_study",
    "warm_starts",
    "choose",
    "production_capacity",
    "tuned_keys",
    "for_production",
    "TuningChild",
]

TUNING_REQUESTS = 400  # requests in a re-tuning study's synthesized trace
MIN_GAIN = 0.02  # a gain below 2 % of production's capacity is not worth a restart, however sure it is
WARM_SHARE = 3  # earlier winners take at most a third of a tuning's trial budget
WARM_TOP = 3  # and never more than this many


def load_staging(path: Path, root: Path) -> StudyDefinition:
    """The staging study as the daemon's tunings run it. A file that names no ``runs_dir`` keeps its tunings'
    runs (engine logs, best configs, reports) under the daemon's state directory, ``root``/tunings/runs, and
    its Optuna storage there too when it names none: never a ``runs/`` in the daemon's working directory
    (``/`` under systemd, where nothing may be written). Its workload must name a tokenizer: the daemon builds
    prompts like production's with it (checked when the daemon starts and when it reloads, not at a drift)."""
    study = load_study(path, default_runs_dir=root / "tunings" / "runs")
    if study.workload.tokenizer is None:
        raise ConfigError(
            f"{path}: the daemon builds prompts like production's with the model's "
            "tokenizer: set [workload].tokenizer (or engine.args.tokenizer) to a local directory"
        )
    return study


def write_tuning_study(
    template: Path,
    staging: StudyDefinition,
    path: Path,
    *,
    name: str,
    slos: list[str],
    fingerprint: Fingerprint,
    seed: int,
    deployed: dict[str, Any] | None,
    prefix: str,
    trace: Path | None = None,
    engine_env: dict[str, str] | None = None,
) -> Path:
    """The staging study with production's traffic (``trace``, or synthesized from ``fingerprint``) and
    production's config and earlier winners (studies named ``prefix``*) as baselines."""
    kind = staging.command.engine_kind
    mml = staging.fixed.values.get(kind.context_length) if kind.context_length else None
    workload = workload_from(
        fingerprint, requests=TUNING_REQUESTS, seed=seed, max_model_len=int(mml) if mml else None, name=name
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    requests = None  # a trace the operator configured: the staging study's own cap
    if trace is None:
        trace = path.with_suffix(".jsonl")
        assert staging.workload.tokenizer is not None  # the daemon's staging study names one: checked when it starts
        builder = PromptBuilder(load_tokenizer(staging.workload.tokenizer))
        write_trace(materialize(workload, builder, seed=0), trace)
        # every synthesized request: a load step past the first 200 would replay identical prompts, which the
        # prefix cache serves for free and so flatter prefix caching at high loads
        requests = len(workload.requests)
    names = set(build_space(staging).names())
    baselines: dict[str, dict[str, Any]] = {}
    production = {k: v for k, v in (deployed or {}).items() if k in names}
    if production:
        baselines["production"] = production
    for i, values in enumerate(warm_starts(staging, prefix, production)):
        baselines[f"earlier-{i + 1}"] = values
    return derive_study(
        template,
        path,
        name=name,
        storage=staging.storage,
        runs_dir=staging.runs_dir,
        slos=slos,
        trace=trace,
        tokenizer=staging.workload.tokenizer,
        step_duration=f"{max(workload.span_s / 2, 10):.0f}s",
        baselines=baselines,
        engine_env=engine_env,
        requests=requests,
    )


def move_to_gpus(study_file: Path, gpus: str) -> None:
    """Point a tuning's study file at other GPUs ([engine.env] CUDA_VISIBLE_DEVICES): after a blue/green
    rollback swapped which color is idle, the resumed tuning runs on the new idle color's GPUs."""
    import tomli_w

    from autotune.configfile import read_toml
    from autotune.locations import atomic_write

    data = read_toml(study_file, "tuning study")
    data.setdefault("engine", {}).setdefault("env", {})["CUDA_VISIBLE_DEVICES"] = gpus
    data["engine"].pop("gpus", None)  # the idle color's GPUs are one slot
    atomic_write(study_file, tomli_w.dumps(data))


def _norm(values: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A config as a comparable key: floats rounded (0.8600000000000001 is 0.86)."""
    return tuple(sorted((k, round(v, 6) if isinstance(v, float) else v) for k, v in values.items()))


def warm_starts(staging: StudyDefinition, prefix: str, production: dict[str, Any]) -> list[dict[str, Any]]:
    """The configs of earlier winners worth measuring again: the best feasible trial configs (as they ran)
    of the studies named ``prefix``*, best first, without those the tuning measures anyway (production's
    config, the study's own baselines such as vllm-defaults) and without repeats; at most a third of
    the trial budget, and never so many that no sampled trial is left."""
    space = build_space(staging)
    names = set(space.names())
    extra = [(b.name, b.values) for b in staging.baselines if b.name != "production"]
    if production:
        extra.append(("production", production))
    # what the study runs anyway, as it runs it: the point, overridden by values the space does not reach
    points = baseline_points(space, staging.builtin_baselines, extra)
    seen = {_norm({k: v for k, v in {**b.params, **b.extra_args}.items() if k in names}) for b in points}
    cap = WARM_TOP
    if staging.budget.trials is not None:
        cap = min(cap, staging.budget.trials // WARM_SHARE, max(staging.budget.trials - len(points) - 1, 0))
    found: list[tuple[float, dict[str, Any]]] = []
    try:
        summaries = optuna.get_all_study_summaries(staging.storage)
    except Exception:  # noqa: BLE001 - no storage yet (what says so depends on the backend): nothing learned
        return []
    for s in summaries:
        if s.study_name.startswith(prefix):
            for r in StudyResult.load(staging.storage, s.study_name).records:
                if r.feasible and r.values and r.values[0] > 0 and not r.capacity_at_least:  # a floor ranks nothing
                    found.append((r.values[0], {k: v for k, v in r.config.items() if k in names}))
    found.sort(key=lambda x: -x[0])
    out: list[dict[str, Any]] = []
    for _, values in found:
        if len(out) >= cap:
            break
        try:
            key = _norm(space.complete(values))
        except Exception:  # noqa: BLE001 - the space changed and no longer takes a value, however it fails: as it is
            key = _norm(values)
        if key not in seen:
            seen.add(key)
            out.append(values)
    return out


def tuned_keys(staging: StudyDefinition, ran: Mapping[str, Any]) -> set[str]:
    """The engine args a tuning varied: the space's knobs, and whatever else a trial ran that the staging study
    does not fix (a baseline's own values, the space's rules). What the staging study fixes for staging alone (its
    tokenizer, its max_model_len) is not among them."""
    fixed = staging.fixed.values
    return set(build_space(staging).names()) | {k for k, v in ran.items() if k not in fixed or fixed[k] != v}


def for_production(deployed: Mapping[str, Any] | None, ran: Mapping[str, Any], tuned: set[str]) -> dict[str, Any]:
    """Production's config with a tuning's winner in it: every key production has keeps its value, except the
    ``tuned`` keys, which take the values the winner ran with (a tuned key it ran without is unset, as it ran)."""
    kept = {k: v for k, v in (deployed or {}).items() if k not in tuned}
    return {**kept, **{k: v for k, v in ran.items() if k in tuned}}


@dataclass(frozen=True)
class Choice:
    """What a finished tuning means for production: the trial whose config to publish (None: production's
    stays), and why, in numbers. ``winner`` is the trial the tuning's verdict stands on, published or not: the
    study's winner, or the baseline that stands for it when the two tie."""

    trial: int | None
    why: str
    winner: int


def choose(result: StudyResult) -> Choice:
    """Publish only a config that surely beats production by more than a gain worth a restart.

    Every measurement the study made of the two configs (each ladder that ran them, each re-measured run) goes
    into one posterior of their capacities (``study/posterior.py``: heavy-tailed noise, so one stalled run moves it
    a little); the config is published when that posterior gives it at least the verdict's confidence (0.9 by
    default) of a capacity above production's by more than MIN_GAIN, and never less than the re-measurement's step
    (1.05x): capacities one step apart may be one config. The study's own verdict compares its winner with the
    best *baseline*: when they tie, the winner is no better than that baseline, and the baseline (a known
    config, such as vLLM's defaults) is the one to weigh against production. Production's capacity is its re-measured
    median if it was re-measured, else its one measurement. Without a production baseline (nothing
    known about production's config), the study's verdict decides; with one that measured nothing
    (interrupted, failed), production's capacity is unknown, not 0: nothing is published.
    """
    verdict = result.remeasurement
    assert verdict is not None
    cands = {c["label"]: c for c in verdict.candidates}
    pick = cands[verdict.winner]
    tie = ""
    if verdict.winner != verdict.baseline and not verdict.significant:
        pick = cands[verdict.baseline]
        tie = (
            f"{verdict.winner} and {verdict.baseline} tie ({_differ(verdict.gain_rps, verdict.noise_rps)}), "
            f"so {verdict.baseline} stands for both; "
        )
        if verdict.baseline_at_least:
            tie = (
                f"{verdict.baseline} held every load it was offered, so {verdict.winner}'s lead over it is "
                f"unknown and {verdict.baseline} stands for both; "
            )
    decided = partial(Choice, winner=pick["trial"])
    tried = [r for r in result.records if r.baseline == "production"]
    prod = _measured_production(result)
    if not tried:  # the study's own verdict decides, said in the study's words
        return decided(pick["trial"] if verdict.significant else None, verdict.sentence())
    if any(pick["trial"] == r.number for r in tried):
        return decided(None, f"{tie}production's own config won")
    ran = (result.trial(pick["trial"]).attrs.get(Attr.ENGINE_ARGS) or {}).get("values")
    if ran is not None and any(
        _norm(ran) == _norm(r.attrs[Attr.ENGINE_ARGS].get("values") or {})
        for r in tried
        if r.attrs.get(Attr.ENGINE_ARGS)
    ):
        return decided(None, f"{tie}{pick['label']} runs production's own config")
    if prod is None:  # interrupted or failed: production's capacity is unknown, not zero
        how = ", ".join(f"trial {r.number} {r.state.name.lower()}" for r in tried)
        return decided(
            None,
            f"{tie}production's baseline has no measurement ({how}): nothing to compare "
            f"{pick['label']} with; production's capacity is unknown, not 0",
        )
    remeasured = verdict.candidate(prod.number)
    prod_cap = remeasured["median"] if remeasured else prod.capacity_rps
    if remeasured.get("at_least", False) if remeasured else prod.capacity_at_least:
        return decided(
            None,
            f"{tie}production's config held every load it was offered: {prod_cap:.2f} req/s is where "
            "its ladder stopped, not its capacity, so no gain over it can be stated (a higher "
            "[objective] max_steps in the staging study finds it)",
        )
    # two capacities one re-measurement step apart may be the same config, as the study's verdict holds too
    share = max(MIN_GAIN, step_share(verdict.resolution))
    confidence = verdict.confidence if verdict.confidence is not None else CONFIDENCE
    post = Posterior.of([result.evidence_of(pick["trial"]), result.evidence_of(prod.number)])
    p = post.p_better(0, 1, share)
    gain = pick["median"] - prod_cap
    at_least = "at least " if pick.get("at_least") else ""
    numbers = f"{pick['label']} {at_least}{pick['median']:.2f} req/s vs production {prod_cap:.2f}: {gain:+.2f} req/s"
    # the margin in words: a restart is worth a gain above MIN_GAIN, and the ladder resolves no finer than its step
    margin = (
        f"{share:.0%} (a gain worth a restart)"
        if share == MIN_GAIN
        else f"{share:.0%} (the re-measurement ladder's {verdict.resolution:g}x step)"
    )
    said = f"P = {p:.2f} that it beats production by more than {margin}, {confidence:g} required"
    if p >= confidence:
        return decided(pick["trial"], f"{tie}{numbers}; {said}")
    return decided(None, f"{tie}{numbers}, not surely a gain ({said})")


def _measured_production(result: StudyResult) -> TrialRecord | None:
    """The `production` baseline trial that measured something: the last one to complete. An interrupted
    one (FAIL: the daemon stopped mid-trial) or one that crashed measured nothing, whatever its capacity
    attribute says; a re-run after it is the measurement."""
    done = [
        r
        for r in result.records
        if r.baseline == "production" and r.state == TrialState.COMPLETE and Attr.CAPACITY_RPS in r.attrs
    ]
    return done[-1] if done else None


def production_capacity(result: StudyResult) -> float | None:
    """Production's config's capacity on staging as a tuning measured it: its re-measured median if it was
    re-measured, else its one measurement; None when its baseline measured nothing (unknown, not 0)."""
    prod = _measured_production(result)
    if prod is None:
        return None
    remeasured = result.remeasurement.candidate(prod.number) if result.remeasurement is not None else None
    return float(remeasured["median"]) if remeasured else prod.capacity_rps


def _differ(gain: float, noise: float, said: str | None = None) -> str:
    """A gain against the noise (``said``: the noise in words, else its number), in words that never say
    "0.00 > 0.00"."""
    said = said or f"{noise:.2f}"
    if f"{gain:.2f}" == f"{noise:.2f}":
        return f"a gain of {gain:+.2f} req/s, at the noise ({said}): not more"
    return f"{gain:+.2f} req/s, within the noise ({said})"


class TuningChild:
    """``autotune study FILE`` in its own process group, its output appended to ``log``.

    Its lifecycle: built (nothing runs) -> ``start()`` (the process runs; a second start raises) -> ``poll()``
    answers its exit code once it ended -> ``stop()`` ends it early (the study stays resumable)."""

    def __init__(self, argv: list[str], study_file: Path, log: Path) -> None:
        self.argv, self.study_file, self.log = list(argv), study_file, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> TuningChild:
        if self.proc is not None:
            raise RuntimeError(f"the tuning of {self.study_file} was started already")
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [*self.argv, "study", str(self.study_file)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        return self

    def poll(self) -> int | None:
        """The exit code once the study ended; None while it runs (or before it started)."""
        return None if self.proc is None else self.proc.poll()

    def stop(self, grace: float = 60.0) -> None:
        """SIGINT the study (it stops its engine and stays resumable); SIGKILL the group after ``grace``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            self.proc.wait(timeout=grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
