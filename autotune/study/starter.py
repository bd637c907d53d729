"""A study from a few flags: the annotated file `autotune init` writes and a file-free `autotune study` runs.

`autotune study --model M --slo 'ttft<800ms' --rate 4` needs no file; it writes this one under
``runs/<name>/study.toml`` and runs it, so the file-free start leads straight to the file: the
same study, every default spelled out with a comment, ready to edit and rerun. Nothing is
written here that `load_study` would not read back to the same definition.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from autotune.engine.command import EngineCommand
from autotune.engine.gpu import GpuInfo
from autotune.engine.model import locate
from autotune.errors import ConfigError
from autotune.measure.slo import SLO

__all__ = ["StudyRequest", "Platform", "check_request", "default_path", "render_study", "study_name", "validated"]


@dataclass(frozen=True)
class StudyRequest:
    """What a person typed: the model, the SLOs, the traffic, and optionally the engine and the budget."""

    model: str
    slos: tuple[SLO, ...]  # parsed once, from the flags
    engine_command: str
    workload: Path | None = None  # a trace file; else the synthetic scenario
    scenario: str | None = None
    rate: float | None = None
    requests: int = 200
    tokenizer: Path | None = None
    trials: int = 20
    name: str | None = None
    port: int = 8100
    runs_dir: Path = Path("runs")
    extra_args: dict[str, Any] = field(default_factory=dict)  # fixed engine args, e.g. max_model_len


@dataclass(frozen=True)
class Platform:
    """Where the engine runs: what NVML saw here, or what the engine's command declares (vllm-sim's --gpu)."""

    name: str  # "cuda" or "cpu"
    gpus: tuple[GpuInfo, ...]
    declared: bool  # the GPUs come from the engine's command, not from NVML on this host


def study_name(req: StudyRequest) -> str:
    """``tiny-llama-chat``: the model's last path part and the traffic's name, in the characters a name may hold."""
    if req.name:
        return req.name
    traffic = req.workload.stem if req.workload is not None else (req.scenario or "chat")
    raw = f"{Path(req.model.rstrip('/')).name}-{traffic}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", raw).strip("-.") or "study"


def default_path(req: StudyRequest) -> Path:
    """Where a study from flags lives: ``runs/<name>/study.toml`` (what `autotune study --model ...` writes and
    resumes, and `autotune init` writes unless told otherwise)."""
    return req.runs_dir / study_name(req) / "study.toml"


def check_request(req: StudyRequest) -> None:
    """Every missing piece as one line saying what to add, before anything is written."""
    if not req.slos:
        raise ConfigError(
            "give the latency promise to tune for: --slo 'ttft<800ms' (repeatable; 'p99:ttft<1s', 'tpot<50ms', 'rps>5')"
        )
    if req.workload is None and req.rate is None:
        raise ConfigError(
            "say what traffic to tune for: --workload trace.jsonl (recorded, e.g. by autotune capture), "
            "or --rate R requests/s for the synthetic chat scenario (--scenario picks another)"
        )
    if req.workload is not None and req.scenario is not None:
        raise ConfigError("give either --workload FILE or --scenario NAME, not both")
    if req.workload is not None and not req.workload.is_file():
        raise ConfigError(f"--workload {req.workload}: no such file")
    if Path(req.model).is_dir() and not (Path(req.model) / "config.json").is_file():
        raise ConfigError(f"--model {req.model} has no config.json: give the directory the model was downloaded to")
    if req.tokenizer is not None and not req.tokenizer.exists():
        raise ConfigError(f"--tokenizer {req.tokenizer}: no such file or directory")
    if req.tokenizer is None and req.workload is None:  # a synthetic workload's prompts are built with it
        files = locate(req.model)
        if files.tokenizer is None and files.directory is None and not files.on_hub:
            raise ConfigError(f"{files.found}: give --model the directory the model was downloaded to")
        if files.tokenizer is None:
            where = f"{files.directory} holds no tokenizer.json" if files.directory is not None else files.found
            raise ConfigError(
                f"{where}: the prompts are built with the model's tokenizer: rerun with --download to "
                f"fetch its config and tokenizer (or `{files.fetch_command()}`), or add --tokenizer DIR"
            )
    if req.trials < 1:
        raise ConfigError("--trials must be at least 1")


def _toml_value(value: Any) -> str:
    """One TOML value on one line, as it appears after ``key = `` (tables and arrays inline)."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return tomli_w.dumps({"x": value}).split("=", 1)[1].strip()


def _abs(path: Path | str) -> str:
    return str(Path(path).resolve())


def _workload_lines(req: StudyRequest) -> list[str]:
    """The study file's [workload]: the trace given, or the synthetic scenario at the rate given."""
    out = ["", "[workload]"]
    if req.workload is not None:
        out.append(f"trace = {_toml_value(_abs(req.workload))}   # arrivals and lengths as recorded")
        if req.rate is not None:
            out.append(f"rate = {_toml_value(req.rate)}            # arrivals for a file without arrival times")
    else:
        out += [
            f"scenario = {_toml_value(req.scenario or 'chat')}          # chat, long-docs or high-concurrency",
            f"rate = {_toml_value(req.rate)}                   # requests/s; each trial's load ladder starts here",
            f"requests = {req.requests}",
        ]
    if req.tokenizer is not None:
        out.append(f"tokenizer = {_toml_value(_abs(req.tokenizer))}   # prompts are built with the engine's tokenizer")
    return out


def render_study(
    req: StudyRequest,
    platform: Platform,
    default_space: dict[str, dict[str, Any]],
    tokenizer_arg: str | None,
    path: Path | None = None,
) -> str:
    """The study file, every line a person may want to change commented.

    Paths are absolute, so the file reruns the same study from any directory.
    """
    name = study_name(req)
    runs = _abs(req.runs_dir)
    slos = ", ".join(_toml_value(s.text) for s in req.slos)
    out = [
        f"# autotune study {name}. Run (or resume) it:  autotune study {_abs(path or default_path(req))}",
        "# Edit anything below; 'Writing a study' in autotune's docs/study-file.md documents every key.",
        f"name = {_toml_value(name)}",
        "# p95 unless a percentile is given: 'p99:ttft<1s', 'mean:tpot<50ms', 'itl<...', 'e2e<...', 'rps>5'",
        f"slos = [{slos}]",
        "# every trial, for `autotune report` and `autotune dashboard` (PostgreSQL to share it between hosts)",
        f"storage = {_toml_value(f'sqlite:///{runs}/studies.db')}",
        f"runs_dir = {_toml_value(runs)}             # engine logs, the best config, the report",
    ]
    out += _engine_lines(req, platform, tokenizer_arg)

    out += [
        "",
        "# No [space]: the platform's default space for this GPU and model, searched as below.",
        "# To search fewer knobs or other ranges, uncomment [space] and edit it:",
        "# [space]",
    ]
    out += [f"# {k} = {_toml_value(v)}" for k, v in default_space.items()]

    out += _workload_lines(req)
    out += [
        "",
        "[objective]",
        'kind = "capacity"              # the most requests/s that meet every SLO',
        "max_steps = 4                  # load steps per trial: doubles while the SLOs hold, then bisects",
        "",
        "[budget]",
        f"trials = {req.trials}                    # in all, baselines included; a rerun resumes",
        '# timeout = "4h"',
        "",
        "# [baselines]: vLLM's defaults and the other built-in baselines run first; every result is",
        "# shown as a gain over them. Add your production config to be compared with it too:",
        "# [baselines]",
        "# production = { max_num_seqs = 256, gpu_memory_utilization = 0.9 }",
        "",
    ]
    return "\n".join(out)


def _engine_lines(req: StudyRequest, platform: Platform, tokenizer_arg: str | None) -> list[str]:
    """The study file's [engine], [engine.gpu] and [engine.args] tables."""
    local = Path(req.model).is_dir()
    command = EngineCommand.parse_command(req.engine_command)  # a bad command line fails here, not at trial 0
    out = [
        "",
        "[engine]",
        f"command = {_toml_value(' '.join(command))}",
        f"model = {_toml_value(_abs(req.model) if local else req.model)}",
    ]
    if platform.name == "cpu":
        out.append('platform = "cpu"               # no NVIDIA GPU was visible to NVML: vLLM\'s CPU backend')
    else:
        g = platform.gpus[0]
        seen = "declared by the engine command" if platform.declared else "found by NVML"
        out.append(f'platform = "cuda"              # {len(platform.gpus)}x {g.name}, {seen}')
    out += [
        f"port = {req.port}                     # staging engine port (localhost)",
        'startup_timeout = "15m"        # a start slower than this is a failed trial',
    ]
    if platform.declared:
        g = platform.gpus[0]
        out += [
            "",
            "[engine.gpu]                   # the GPU the default space and the pre-check size for",
            f"name = {_toml_value(g.name)}",
            f'memory = "{g.total_bytes >> 20}MiB"',
            f"count = {len(platform.gpus)}",
        ]
    fixed = dict(req.extra_args)
    if req.tokenizer is not None and not local and tokenizer_arg is not None:
        fixed.setdefault(tokenizer_arg, _abs(req.tokenizer))  # the engine counts tokens as the prompts were built
    out += ["", "[engine.args]                  # fixed for every trial: the search never changes these"]
    out += [f"{k} = {_toml_value(v)}" for k, v in fixed.items()] or ["# max_model_len = 8192"]
    return out


def validated(text: str) -> str:
    """``text`` if it loads as a study (it always should: a bug otherwise), before any file holds it."""
    import tempfile

    from autotune.study.definition import load_study

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "study.toml"
        path.write_text(text, encoding="utf-8")
        load_study(path)
    return text
