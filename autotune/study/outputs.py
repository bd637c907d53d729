"""What a finished study hands the user: the winner as the engine's config file and a command line,
and the table of the winner against every baseline."""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from autotune.engine.kind import EngineKind
from autotune.engine.secrets import REDACTED, redact
from autotune.locations import atomic_write
from autotune.study.records import StudyResult, TrialRecord

__all__ = ["NOT_RECOMMENDED", "Row", "comparison", "write_best", "write_verdict"]

# the stem of the files of a searched config that led the re-measurement within the noise: kept, not deployed
NOT_RECOMMENDED = "not-recommended"


@dataclass
class Row:
    label: str
    trial: int
    capacity_rps: float
    output_tok_s: float
    ttft_p95_ms: float | None
    feasible: bool
    state: str
    at_least: bool = False  # every load offered held: capacity_rps is a floor


def _row(t: TrialRecord, label: str) -> Row:
    top = t.capacity_step
    return Row(
        label,
        t.number,
        t.capacity_rps,
        top.output_throughput if top else 0.0,
        top.ttft_p95 * 1000 if top and top.ttft_p95 is not None else None,
        t.feasible,
        t.state.name.lower(),
        t.capacity_at_least,
    )


def comparison(result: StudyResult, winner: TrialRecord | None) -> list[Row]:
    rows = []
    if winner is not None:
        rows.append(_row(winner, f"best (trial {winner.number})"))
    for t in result.baselines():
        # a baseline's label is its name: baselines() holds only the trials that have one
        rows.append(_row(t, t.label + (f" [{t.failure_class}]" if t.failure_class else "")))
    return rows


def write_best(
    t: TrialRecord,
    model: str,
    engine: EngineKind,
    out_dir: Path,
    real_env: Mapping[str, str] | None = None,
    stem: str = "best",
    why: str | None = None,
    version: str | None = None,
    capacity: tuple[float, str] | None = None,
) -> dict[str, Path]:
    """The engine's config file (vLLM: best.yaml for `vllm serve --config`; env vars as comments: YAML
    configs cannot set them), best-command.sh (exactly what was measured) and best.json, each 0600.

    Secrets are redacted in the trial's record; best-command.sh must run, so it gets their real values
    from ``real_env`` (the study's [engine.env]), else reads them from the environment it runs in.
    ``stem`` names the files (``best``; :data:`NOT_RECOMMENDED` for a leader within the noise, whose
    ``why`` heads each file). Where the engine has an official container, ``best-docker.sh`` runs it on the
    config file (``version``: the engine's version the study measured, the image's tag). ``capacity``: the
    config's capacity as the study states it (StudyResult.capacity_of; default: its trial's)."""
    paths: dict[str, Path] = {}
    args = t.engine_args
    values = engine.production_values(args.values)
    env = redact(args.env)  # a record from before secrets were redacted
    what = "best config" if stem == "best" else "NOT RECOMMENDED config"
    capacity_rps, capacity_said = capacity or (t.capacity_rps, f"{t.capacity_rps:.2f} req/s")
    if engine.config_file is not None:
        config_file = str(Path(engine.config_file).with_stem(stem))
        header = [
            f"autotune: {what} of trial {t.number}, capacity {capacity_said}",
            *([why] if why else []),
            f"run: {engine.config_usage} {config_file}",
        ]
        if values != dict(args.values):  # staging measured without reading weights; production must read them
            header.append("(trials ran with load_format dummy; left out here so the real weights load)")
        if env:
            header.append("with environment: " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()))
        paths["config"] = out_dir / config_file
        atomic_write(paths["config"], engine.render_config(model, values, header))
        if (line := engine.container_line(model, paths["config"], env, version)) is not None:
            paths["docker"] = out_dir / f"{stem}-docker.sh"
            atomic_write(
                paths["docker"],
                f"#!/bin/sh\n# autotune: {engine.config_file.replace('best', stem)} in "
                f"the engine's official container\nexec {line}\n",
            )
    argv = t.argv  # exactly what was measured (staging host, port and load format)
    run_env = args.revealed(real_env or {}).env
    env_prefix = "env " + " ".join(f"{k}={_shell_value(k, v)}" for k, v in run_env.items()) + " " if run_env else ""
    paths["command"] = out_dir / f"{stem}-command.sh"
    comment = "".join(f"# autotune: {line}\n" for line in [*([why] if why else []), f"trial {t.number}, as measured"])
    atomic_write(paths["command"], f"#!/bin/sh\n{comment}exec {env_prefix}{shlex.join(argv)}\n")
    paths["json"] = out_dir / f"{stem}.json"
    record = {"trial": t.number, "argv": argv, "env": env, "values": values, "capacity_rps": capacity_rps}
    atomic_write(paths["json"], json.dumps({**record, **({"not_recommended": why} if why else {})}, indent=2) + "\n")
    return paths


def write_verdict(
    result: StudyResult,
    model: str,
    engine: EngineKind,
    out_dir: Path,
    real_env: Mapping[str, str] | None = None,
    version: str | None = None,
) -> dict[str, Path]:
    """The files of the config the study declares best (:attr:`StudyResult.winner`: the re-measurement's
    verdict where there is one); a searched config that led within the noise goes beside them under
    :data:`NOT_RECOMMENDED` (keys ``not-recommended-config`` and so on), and an earlier verdict's such files
    are removed. Nothing is written in Pareto mode or when no config met the SLOs."""
    for stale in out_dir.glob(f"{NOT_RECOMMENDED}*"):
        stale.unlink()
    winner = None if result.pareto else result.winner
    if winner is None:
        return {}
    of = result.capacity_of
    paths = write_best(winner, model, engine, out_dir, real_env, version=version, capacity=of(winner))
    if (leader := result.leader) is not None and result.remeasurement is not None:
        why = f"not recommended: re-measured, {result.remeasurement.sentence()}"
        kept = write_best(leader, model, engine, out_dir, real_env, NOT_RECOMMENDED, why, version, of(leader))
        paths.update({f"{NOT_RECOMMENDED}-{k}": v for k, v in kept.items()})
    return paths


def _shell_value(name: str, value: str) -> str:
    """A value for the shell; a secret whose value is not known here comes from the caller's environment."""
    if value == REDACTED and name.isidentifier():
        return f'"${{{name}:?is not stored by autotune: export it}}"'
    return shlex.quote(value)
