"""Study definitions: ``studies/*.toml`` read into typed settings, CLI flags on top.

The format is documented in the README ("Writing a study"). Every mistake is a ConfigError
naming the file, the key and what to write instead.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from autotune.engine.args import EngineArgs, EngineCommand
from autotune.engine.gpu import GpuInfo
from autotune.engine.model import parse_bytes
from autotune.errors import ConfigError
from autotune.units import parse_duration
from autotune.study.scoring import KINDS as SCORING_KINDS
from autotune.study.scoring import Scoring, scoring_for
from autotune.study.space import Param
from autotune.measure.slo import SLO, parse_slos
from autotune.workload.source import WorkloadSpec

__all__ = ["StudyDefinition", "Objective", "Budget", "Baseline", "load_study", "read_toml", "derive_study"]

_TOP = {"name", "storage", "heartbeat", "engine", "space", "workload", "slos", "objective", "budget", "baselines", "sampler",
        "precheck", "remeasure", "seed", "runs_dir"}


@dataclass(frozen=True)
class Objective:
    kind: str = "capacity"  # "capacity": highest load meeting every SLO; "pareto": throughput vs p95 TTFT
    start_load: float = 1.0  # first load step, as a multiple of the workload's rate
    max_steps: int = 4  # load steps per trial, at most
    resolution: float = 1.25  # stop refining when the failing load is within this factor of the passing one
    step_seconds: float | None = None  # how long each load step offers its load (default: the workload's span)

    def scoring(self) -> Scoring:
        return scoring_for(self.kind, self.start_load, self.max_steps, self.resolution)


@dataclass(frozen=True)
class Budget:
    trials: int | None = 20  # trials in the study in all (baselines included); reruns resume toward it
    timeout_s: float | None = None


@dataclass(frozen=True)
class Baseline:
    name: str
    values: dict[str, Any]


@dataclass(frozen=True)
class StudyDefinition:
    name: str
    command: EngineCommand
    fixed: EngineArgs
    params: tuple[Param, ...] | None  # None: the platform's default space
    platform: str  # "cuda" or "cpu"
    workload: WorkloadSpec
    slos: list[SLO]
    objective: Objective = field(default_factory=Objective)
    budget: Budget = field(default_factory=Budget)
    storage: str = ""
    sampler: str = "tpe"
    seed: int | None = None
    baselines: tuple[Baseline, ...] = ()
    builtin_baselines: tuple[str, ...] | None = None  # None: every one the engine kind names
    precheck: bool = True
    remeasure_top: int = 2
    remeasure_repeats: int = 3
    startup_timeout_s: float = 900.0
    runs_dir: Path = Path("runs")
    source: Path | None = None
    gpus: tuple[GpuInfo, ...] | None = None  # [engine.gpu]: the engine's devices when NVML here cannot see them
    heartbeat_s: float = 60.0  # shared storage: how often a worker proves its running trial is alive

    @property
    def run_dir(self) -> Path:
        return self.runs_dir / self.name

    def with_overrides(self, *, slos: list[str] | None = None, trials: int | None = None,
                       timeout: str | None = None, storage: str | None = None, name: str | None = None) -> StudyDefinition:
        d = self
        if slos:
            d = replace(d, slos=parse_slos(slos))
        if trials is not None:
            if trials < 1:
                raise ConfigError("--trials must be at least 1")
            d = replace(d, budget=replace(d.budget, trials=trials))
        if timeout is not None:
            d = replace(d, budget=replace(d.budget, timeout_s=parse_duration(timeout, "--timeout")))
        if name:
            d = replace(d, name=name)
        if storage:
            d = replace(d, storage=storage)
        if not d.storage:
            d = replace(d, storage=_default_storage(d))
        return d


def _default_storage(d: StudyDefinition) -> str:
    return f"sqlite:///{(d.runs_dir / 'studies.db').as_posix()}"


class _Table:
    """A TOML table that remembers which keys were read, to name the ones that were not."""

    def __init__(self, data: dict, where: str) -> None:
        if not isinstance(data, dict):
            raise ConfigError(f"{where} must be a table")
        self.data, self.where, self.seen = data, where, set()

    def get(self, key: str, default: Any = None, kind: type | tuple[type, ...] | None = None) -> Any:
        self.seen.add(key)
        value = self.data.get(key, default)
        if kind is not None and key in self.data and not isinstance(value, kind):
            names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            raise ConfigError(f"{self.where}.{key} must be a {names}, got {value!r}")
        return value

    def require(self, key: str, kind: type | tuple[type, ...] | None = None) -> Any:
        if key not in self.data:
            raise ConfigError(f"{self.where}.{key} is missing")
        return self.get(key, kind=kind)

    def done(self) -> None:
        extra = set(self.data) - self.seen
        if extra:
            raise ConfigError(f"{self.where}: unknown key(s) {', '.join(sorted(extra))}; see 'Writing a study' in the README")


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """A TOML file's tables, or a ConfigError that names the file and what is wrong."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {str(p)!r} does not exist")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None


def load_study(path: str | Path, *, default_platform: str | None = None) -> StudyDefinition:
    p = Path(path)
    data = read_toml(p, "study file")
    unknown = set(data) - _TOP
    if unknown:
        raise ConfigError(f"{p}: unknown key(s) {', '.join(sorted(unknown))}; see 'Writing a study' in the README")
    where = p.name
    name = data.get("name") or p.stem
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", str(name)):
        raise ConfigError(f"{where}: name {name!r} may only hold letters, digits, '.', '_' and '-'")

    eng = _Table(data.get("engine", {}), f"{where} [engine]")
    model = eng.require("model", str)
    command = EngineCommand.parse_command(eng.get("command", "vllm serve", str))
    platform = eng.get("platform", default_platform or "cuda", str)
    if platform not in ("cuda", "cpu"):
        raise ConfigError(f"{where} [engine].platform must be 'cuda' or 'cpu', got {platform!r}")
    args = eng.get("args", {}, dict)
    env = {str(k): str(v) for k, v in eng.get("env", {}, dict).items()}
    engine = EngineCommand(model=model, command=command, host=eng.get("host", "127.0.0.1", str),
                           port=eng.get("port", 8100, int),
                           allow_trust_remote_code=eng.get("allow_trust_remote_code", False, bool),
                           # on a CPU host the engine and the replay client share the cores: the client goes first
                           nice=eng.get("nice", 10 if platform == "cpu" else 0, int),
                           kind=eng.get("kind", "", str))
    engine.engine_kind  # an unknown kind is an error now, not at the first trial
    startup = parse_duration(eng.get("startup_timeout", 900), f"{where} [engine].startup_timeout")
    gpus = _gpus(eng.get("gpu", None, dict), f"{where} [engine.gpu]")
    eng.done()

    params = None
    if "space" in data:
        params = tuple(Param.from_table(k, v, f"{where} [space].{k}")
                       for k, v in _Table(data["space"], f"{where} [space]").data.items())

    wl = _Table(data.get("workload", {}), f"{where} [workload]")
    overrides = {}
    for key in ("prompt_tokens", "output_tokens", "prefix_tokens"):
        if key in wl.data:
            rng = wl.get(key, kind=(list, int))
            rng = [rng, rng] if isinstance(rng, int) else rng
            if len(rng) != 2 or not all(isinstance(x, int) for x in rng):
                raise ConfigError(f"{where} [workload].{key} must be N or [low, high]")
            overrides[key] = tuple(rng)
    for key in ("prefix_groups",):
        if key in wl.data:
            overrides[key] = wl.get(key, kind=int)
    trace = wl.get("trace", None, str)
    workload = WorkloadSpec(
        trace=(p.parent / trace) if trace else None, scenario=wl.get("scenario", None, str),
        rate=wl.get("rate", None, (int, float)), num_requests=wl.get("requests", 200, int),
        burstiness=float(wl.get("burstiness", 1.0, (int, float))), seed=wl.get("seed", 0, int),
        overrides=overrides, api=wl.get("api", None, str),
        tokenizer=_tokenizer(wl.get("tokenizer", None, str), args, model),
    )
    wl.done()
    if (workload.trace is None) == (workload.scenario is None):
        raise ConfigError(f"{where} [workload]: give either trace = FILE or scenario = NAME")

    slos = parse_slos(data.get("slos", []))

    obj = _Table(data.get("objective", {}), f"{where} [objective]")
    objective = Objective(kind=obj.get("kind", "capacity", str), start_load=float(obj.get("start_load", 1.0, (int, float))),
                          max_steps=obj.get("max_steps", 4, int), resolution=float(obj.get("resolution", 1.25, (int, float))),
                          step_seconds=parse_duration(obj.data["step_duration"], f"{where} [objective].step_duration")
                          if "step_duration" in obj.data else None)
    obj.seen.add("step_duration")
    obj.done()
    if objective.kind not in SCORING_KINDS:
        raise ConfigError(f"{where} [objective].kind must be {' or '.join(repr(k) for k in SCORING_KINDS)}, "
                          f"got {objective.kind!r}")
    if objective.kind == "capacity" and not slos:
        raise ConfigError(f"{where}: the capacity objective needs at least one SLO (slos = ['ttft<800ms'] or --slo)")

    bud = _Table(data.get("budget", {}), f"{where} [budget]")
    budget = Budget(trials=bud.get("trials", 20, int),
                    timeout_s=parse_duration(bud.data["timeout"], f"{where} [budget].timeout") if "timeout" in bud.data else None)
    bud.seen.add("timeout")
    bud.done()

    bl = _Table(data.get("baselines", {}), f"{where} [baselines]")
    given = bl.get("builtin", None, list)
    builtin = tuple(given) if given is not None else None
    extra = []
    for item in bl.get("extra", [], list):
        if not isinstance(item, dict) or "name" not in item or not isinstance(item.get("values"), dict):
            raise ConfigError(f"{where} [baselines].extra entries are {{ name = ..., values = {{ ... }} }}")
        extra.append(Baseline(str(item["name"]), dict(item["values"])))
    if "production" in bl.data:
        extra.insert(0, Baseline("production", dict(bl.get("production", kind=dict))))
    bl.done()

    rm = _Table(data.get("remeasure", {}), f"{where} [remeasure]")
    top, repeats = rm.get("top", 2, int), rm.get("repeats", 3, int)
    rm.done()

    sampler = data.get("sampler", "tpe")
    if sampler not in ("tpe", "random", "gp"):
        raise ConfigError(f"{where}: sampler must be 'tpe', 'random' or 'gp', got {sampler!r}")
    d = StudyDefinition(
        name=str(name), command=engine, fixed=EngineArgs(dict(args), env), params=params, platform=platform,
        workload=workload, slos=slos, objective=objective, budget=budget, storage=str(data.get("storage", "")),
        sampler=sampler, seed=data.get("seed"), baselines=tuple(extra), builtin_baselines=builtin,
        precheck=bool(data.get("precheck", True)), remeasure_top=top, remeasure_repeats=repeats,
        startup_timeout_s=startup, runs_dir=Path(data.get("runs_dir", "runs")), source=p, gpus=gpus,
        heartbeat_s=parse_duration(data.get("heartbeat", 60), f"{where} heartbeat"),
    )
    return d.with_overrides()


def _tokenizer(given: str | None, engine_args: dict[str, Any], model: str) -> Path | None:
    """Prompts are built with the tokenizer the engine counts with: the workload's, else vLLM's --tokenizer, else the model's."""
    for candidate in (given, engine_args.get("tokenizer"), model):
        if candidate and Path(str(candidate)).exists():
            return Path(str(candidate))
    return None


def _gpus(spec: dict | None, where: str) -> tuple[GpuInfo, ...] | None:
    """``[engine.gpu] name = "NVIDIA H100 80GB HBM3", memory = "79.6GiB", count = 1``: for an engine on
    devices NVML on this host cannot see (vllm-sim, a remote staging host)."""
    if spec is None:
        return None
    t = _Table(spec, where)
    name = t.require("name", str)
    try:
        memory = parse_bytes(t.require("memory", (str, int)))
    except ValueError:
        raise ConfigError(f"{where}.memory must be a size like \"80GiB\" or a number of bytes") from None
    count = t.get("count", 1, int)
    t.done()
    if count < 1 or memory <= 0:
        raise ConfigError(f"{where}: count and memory must be positive")
    return tuple(GpuInfo(i, name, memory, memory) for i in range(count))


def derive_study(template: Path, out: Path, *, name: str, storage: str, runs_dir: Path, slos: list[str],
                 trace: Path, tokenizer: Path | None, step_duration: str, baselines: dict[str, dict[str, Any]]) -> Path:
    """Write a study file that is ``template`` with another name, workload, SLOs and baselines.

    The daemon's re-tuning studies are made this way: the staging study as the operator wrote it,
    production's traffic as the workload, production's config and earlier winners as baselines
    (``baselines``: name -> values; "production" becomes [baselines].production, the rest extra
    entries, replacing earlier extra entries of the same names). The result is read back with
    ``load_study`` before it is returned, so a bad derivation fails here, not in a child process.
    """
    import tomli_w

    from autotune.locations import atomic_write

    data = read_toml(template, "study file")
    data.update(name=name, storage=storage, runs_dir=str(Path(runs_dir).resolve()), slos=list(slos))
    workload: dict[str, Any] = {"trace": str(Path(trace).resolve())}
    if tokenizer is not None:
        workload["tokenizer"] = str(Path(tokenizer).resolve())
    data["workload"] = workload
    data.setdefault("objective", {}).setdefault("step_duration", step_duration)
    section = data.setdefault("baselines", {})
    extra = [b for b in section.get("extra", []) if b.get("name") not in baselines]
    for label, values in baselines.items():
        if label == "production":
            section["production"] = dict(values)
        else:
            extra.append({"name": label, "values": dict(values)})
    section["extra"] = extra
    atomic_write(out, tomli_w.dumps(data))
    load_study(out)
    return out
