"""What a finished study hands the user: the winner as a vLLM YAML config and a command line,
and the table of the winner against every baseline."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.trial import FrozenTrial, TrialState

from autotune.engine.flags import flag_of
from autotune.study.runner import constraints_of

__all__ = ["Row", "comparison", "write_best", "best_trial"]


@dataclass
class Row:
    label: str
    trial: int
    capacity_rps: float
    output_tok_s: float
    ttft_p95_ms: float | None
    feasible: bool
    state: str


def best_trial(study: optuna.Study) -> FrozenTrial | None:
    """Optuna's best (constraints respected), or None when no trial met the SLOs (or in Pareto mode)."""
    if len(study.directions) > 1:
        return None  # a front, not one best: see console.print_pareto
    try:
        t = study.best_trial
    except ValueError:
        return None
    return t if all(c <= 0 for c in constraints_of(t)) and t.values and t.values[0] > 0 else None


def _row(t: FrozenTrial, label: str) -> Row:
    steps = [s for s in t.user_attrs.get("steps", []) if s["passed"]]
    top = max(steps, key=lambda s: s["load"]) if steps else None
    return Row(label, t.number, float(t.user_attrs.get("capacity_rps", 0.0)),
               top["output_throughput"] if top else 0.0,
               top["ttft_p95"] * 1000 if top and top["ttft_p95"] is not None else None,
               t.state == TrialState.COMPLETE and all(c <= 0 for c in constraints_of(t)), t.state.name.lower())


def comparison(study: optuna.Study, winner: FrozenTrial | None) -> list[Row]:
    rows = []
    if winner is not None:
        rows.append(_row(winner, f"best (trial {winner.number})"))
    for t in study.get_trials(deepcopy=False):
        name = t.user_attrs.get("baseline")
        if name and t.state in (TrialState.COMPLETE, TrialState.PRUNED):
            label = name + (f" [{t.user_attrs['failure_class']}]" if t.user_attrs.get("failure_class") else "")
            rows.append(_row(t, label))
    return rows


def write_best(t: FrozenTrial, model: str, out_dir: Path) -> dict[str, Path]:
    """best.yaml for `vllm serve --config` (env vars as comments: YAML configs cannot set them) and best-command.sh."""
    out_dir.mkdir(parents=True, exist_ok=True)
    args: dict[str, Any] = dict(t.user_attrs["engine_args"]["values"])
    env: dict[str, str] = t.user_attrs["engine_args"]["env"]
    header = [f"# autotune: best config of trial {t.number}, capacity {t.user_attrs.get('capacity_rps', 0):.2f} req/s",
              "# run: vllm serve --config best.yaml"]
    if args.get("load_format") == "dummy":  # staging measured without reading weights; production must read them
        del args["load_format"]
        header.append("# (trials ran with load_format dummy; left out here so the real weights load)")
    config = {"model": model, **{flag_of(k)[2:]: v for k, v in args.items()}}
    if env:
        header.append("# with environment: " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()))
    yaml_path = out_dir / "best.yaml"
    yaml_path.write_text("\n".join(header) + "\n" + yaml.safe_dump(config, sort_keys=False))
    argv = list(t.user_attrs["argv"])  # exactly what was measured (staging host, port and load format)
    env_prefix = "env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " if env else ""
    cmd_path = out_dir / "best-command.sh"
    cmd_path.write_text(f"#!/bin/sh\n# autotune: trial {t.number}, as measured\nexec {env_prefix}{shlex.join(argv)}\n")
    summary = out_dir / "best.json"
    summary.write_text(json.dumps({"trial": t.number, "argv": argv, "env": env, "values": args,
                                   "capacity_rps": t.user_attrs.get("capacity_rps")}, indent=2) + "\n")
    return {"yaml": yaml_path, "command": cmd_path, "json": summary}
