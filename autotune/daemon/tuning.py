"""A re-tuning: the study file it runs, the child process that runs it, and what its verdict means.

A tuning is ``autotune study`` in a child process on a study derived from the staging study
(study.definition.derive_study): production's traffic as its workload, production's config and
the winners of earlier tunings as baselines. Optuna's storage keeps every trial, so a daemon
restart resumes the same study; stopping the daemon interrupts the child (SIGINT), which stops
its staging engine and leaves the study resumable.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from autotune.daemon.fingerprint import Fingerprint, workload_from
from autotune.study.definition import StudyDefinition, derive_study
from autotune.study.records import StudyResult, earlier_winners
from autotune.study.runner import build_space
from autotune.workload.prompts import PromptBuilder, load_tokenizer, materialize
from autotune.workload.trace import write_trace

__all__ = ["TUNING_REQUESTS", "write_tuning_study", "beats_production", "TuningChild"]

TUNING_REQUESTS = 400  # requests in a re-tuning study's synthesized trace


def write_tuning_study(template: Path, staging: StudyDefinition, path: Path, *, name: str, slos: list[str],
                       fingerprint: Fingerprint, seed: int, deployed: dict[str, Any] | None,
                       prefix: str, trace: Path | None = None) -> Path:
    """The staging study with production's traffic (``trace``, or synthesized from ``fingerprint``) and
    production's config and earlier winners (studies named ``prefix``*) as baselines."""
    mml = staging.fixed.values.get("max_model_len")
    workload = workload_from(fingerprint, requests=TUNING_REQUESTS, seed=seed,
                             max_model_len=int(mml) if mml else None, name=name)
    path.parent.mkdir(parents=True, exist_ok=True)
    if trace is None:
        trace = path.with_suffix(".jsonl")
        builder = PromptBuilder(load_tokenizer(staging.workload.tokenizer))
        write_trace(materialize(workload, builder, seed=0), trace)
    names = set(build_space(staging).names())
    baselines: dict[str, dict[str, Any]] = {}
    production = {k: v for k, v in (deployed or {}).items() if k in names}
    if production:
        baselines["production"] = production
    for i, values in enumerate(earlier_winners(staging.storage, prefix, names)):
        baselines[f"earlier-{i + 1}"] = values
    return derive_study(template, path, name=name, storage=staging.storage, runs_dir=staging.runs_dir, slos=slos,
                        trace=trace, tokenizer=staging.workload.tokenizer,
                        step_duration=f"{max(workload.span_s / 2, 10):.0f}s", baselines=baselines)


def beats_production(result: StudyResult) -> tuple[bool, str]:
    """Is the re-measured winner better than production's config by more than the noise?

    The study's own verdict compares the winner with the best *baseline*; what matters here is
    production's config (the "production" baseline): re-measured if it was the best baseline,
    else its one measurement. Without it, the study's verdict decides.
    """
    verdict = result.remeasurement
    assert verdict is not None
    win = verdict.candidate(verdict.winner_trial)
    prod = next((r for r in result.records if r.baseline == "production"), None)
    if prod is None:
        return verdict.significant, f"{verdict.winner} vs {verdict.baseline}: {verdict.gain_rps:+.2f} req/s"
    if win["trial"] == prod.number:
        return False, "production's own config won"
    remeasured = verdict.candidate(prod.number)
    prod_cap = remeasured["median"] if remeasured else prod.capacity_rps
    gain = win["median"] - prod_cap
    why = (f"{verdict.winner} {win['median']:.2f} req/s vs production {prod_cap:.2f}: {gain:+.2f}, "
           f"noise {verdict.noise_rps:.2f}")
    return gain > verdict.noise_rps, why


class TuningChild:
    """``autotune study FILE`` in its own process group, its output appended to ``log``."""

    def __init__(self, argv: list[str], study_file: Path, log: Path) -> None:
        with open(log, "ab") as out:
            self.proc = subprocess.Popen([*argv, "study", str(study_file)], stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, grace: float = 60.0) -> None:
        """SIGINT the study (it stops its engine and stays resumable); SIGKILL the group after ``grace``."""
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            self.proc.wait(timeout=grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
