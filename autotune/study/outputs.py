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
    """best.yaml for `vllm serve --config` (env vars as comments: YAML configs cannot set them) and best-command.sh."""
    out_dir.mkdir(parents=True, exist_ok=True)
    args = t.engine_args
    values = engine.production_values(args.values)
    header = [f"autotune: best config of trial {t.number}, capacity {t.capacity_rps:.2f} req/s",
              "run: vllm serve --config best.yaml"]
    if values != dict(args.values):  # staging measured without reading weights; production must read them
        header.append("(trials ran with load_format dummy; left out here so the real weights load)")
    env = dict(args.env)
    if env:
        header.append("with environment: " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()))
    yaml_path = out_dir / "best.yaml"
    yaml_path.write_text(engine.render_config(model, values, header))
    argv = t.argv  # exactly what was measured (staging host, port and load format)
    env_prefix = "env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " if env else ""
    cmd_path = out_dir / "best-command.sh"
    cmd_path.write_text(f"#!/bin/sh\n# autotune: trial {t.number}, as measured\nexec {env_prefix}{shlex.join(argv)}\n")
    summary = out_dir / "best.json"
    summary.write_text(json.dumps({"trial": t.number, "argv": argv, "env": env, "values": values,
                                   "capacity_rps": t.capacity_rps}, indent=2) + "\n")
    return {"yaml": yaml_path, "command": cmd_path, "json": summary}
