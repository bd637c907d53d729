"""What a finished study hands the user: the winner as the engine's config file and a command line,
and the table of the winner against every baseline."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from autotune.engine.kind import EngineKind
from autotune.study.records import StudyResult, TrialRecord

__all__ = ["Row", "comparison", "write_best"]


@dataclass
class Row:
    label: str
    trial: int
    capacity_rps: float
    output_tok_s: float
    ttft_p95_ms: float | None
    feasible: bool
    state: str


def _row(t: TrialRecord, label: str) -> Row:
    top = t.capacity_step
    return Row(label, t.number, t.capacity_rps, top["output_throughput"] if top else 0.0,
               top["ttft_p95"] * 1000 if top and top["ttft_p95"] is not None else None,
               t.feasible, t.state.name.lower())


def comparison(result: StudyResult, winner: TrialRecord | None) -> list[Row]:
    rows = []
    if winner is not None:
        rows.append(_row(winner, f"best (trial {winner.number})"))
    for t in result.baselines():
        rows.append(_row(t, t.baseline + (f" [{t.failure_class}]" if t.failure_class else "")))
    return rows


def write_best(t: TrialRecord, model: str, engine: EngineKind, out_dir: Path) -> dict[str, Path]:
    """The engine's config file (vLLM: best.yaml for `vllm serve --config`; env vars as comments: YAML
    configs cannot set them), best-command.sh (exactly what was measured) and best.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    args = t.engine_args
    values = engine.production_values(args.values)
    env = dict(args.env)
    if engine.config_file is not None:
        header = [f"autotune: best config of trial {t.number}, capacity {t.capacity_rps:.2f} req/s",
                  f"run: {engine.config_usage} {engine.config_file}"]
        if values != dict(args.values):  # staging measured without reading weights; production must read them
            header.append("(trials ran with load_format dummy; left out here so the real weights load)")
        if env:
            header.append("with environment: " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()))
        paths["config"] = out_dir / engine.config_file
        paths["config"].write_text(engine.render_config(model, values, header))
    argv = t.argv  # exactly what was measured (staging host, port and load format)
    env_prefix = "env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " if env else ""
    paths["command"] = out_dir / "best-command.sh"
    paths["command"].write_text(f"#!/bin/sh\n# autotune: trial {t.number}, as measured\n"
                                f"exec {env_prefix}{shlex.join(argv)}\n")
    paths["json"] = out_dir / "best.json"
    paths["json"].write_text(json.dumps({"trial": t.number, "argv": argv, "env": env, "values": values,
                                         "capacity_rps": t.capacity_rps}, indent=2) + "\n")
    return paths
