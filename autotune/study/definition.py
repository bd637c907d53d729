"""Study definitions: ``studies/*.toml`` read into typed settings, CLI flags on top.

The format is documented in docs/study-file.md ("Writing a study"). Every mistake is a ConfigError
naming the file, the key and what to write instead.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from autotune.configfile import Table, read_toml, show
from autotune.engine.args import EngineArgs, Value
from autotune.engine.command import EngineCommand
from autotune.engine.gpu import GpuInfo
from autotune.engine.kind import EngineKind
from autotune.engine.model import ModelFiles, locate, parse_bytes
from autotune.errors import ConfigError, SLOSyntaxError
from autotune.measure.slo import SLO, parse_slos
from autotune.study.baselines import check_builtin
from autotune.study.scoring import CONFIDENCE, Scoring, scoring_for
from autotune.study.scoring import KINDS as SCORING_KINDS
from autotune.study.slots import INHERIT, VISIBLE, parse_gpu_ids
from autotune.study.space import Param, check_range, default_space
from autotune.units import parse_duration
from autotune.workload.source import WorkloadSpec

__all__ = ["StudyDefinition", "Objective", "Budget", "Baseline", "load_study", "read_slos", "derive_study"]

_TOP = {
    "name",
    "storage",
    "heartbeat",
    "engine",
    "space",
    "workload",
    "slos",
    "objective",
    "budget",
    "baselines",
    "sampler",
    "precheck",
    "remeasure",
    "seed",
    "runs_dir",
}


@dataclass(frozen=True)
class Objective:
    kind: str = "capacity"  # "capacity": highest load meeting every SLO; "pareto": throughput vs p95 TTFT
    start_load: float = 1.0  # first load step, as a multiple of the workload's rate
    max_steps: int = 4  # load steps per trial, at most
    resolution: float = 1.25  # stop refining when the failing load is within this factor of the passing one
    step_seconds: float | None = None  # how long each load step offers its load (default: the workload's span)
    race: bool = True  # a sampled trial starts at the incumbent's capacity and stops if it misses there
    simulate_first: bool = True  # score the space with vllm-sim first, where it models the GPU and the model
    cut_lost_steps: bool = True  # stop a load step once it cannot pass (its first requests are then all it measured)
    replay_workers: int | None = None  # the replay's worker processes; None: as each step's token rate needs

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
    remeasure_repeats: int = 3  # at most, per candidate
    remeasure_confidence: float = CONFIDENCE  # re-measuring stops once the verdict is this sure
    startup_timeout_s: float = 900.0
    runs_dir: Path = Path("runs")
    source: Path | None = None
    gpus: tuple[GpuInfo, ...] | None = None  # [engine.gpu]: the engine's devices when NVML here cannot see them
    gpu_ids: tuple[int, ...] | None = None  # [engine] gpus: where trials run, side by side (study/slots.py)
    heartbeat_s: float = 60.0  # shared storage: how often a worker proves its running trial is alive
    secret_env: tuple[str, ...] = ()  # [engine].secret_env: engine env vars whose values no output shows

    @property
    def run_dir(self) -> Path:
        return self.runs_dir / self.name

    def model_files(self) -> ModelFiles:
        """Where the model's files are, found as vLLM finds them (at the engine's revision)."""
        return locate(self.command.model, self.command.engine_kind.revision(self.fixed.values))

    def with_overrides(
        self,
        *,
        slos: list[str] | None = None,
        trials: int | None = None,
        timeout: str | None = None,
        storage: str | None = None,
        name: str | None = None,
        gpus: str | None = None,
    ) -> StudyDefinition:
        d = self
        if gpus is not None:
            if VISIBLE in d.fixed.env:
                raise ConfigError(
                    f"--gpus and the study's [engine.env] {VISIBLE} both say which GPUs the engine uses: "
                    f"remove {VISIBLE} from the study file to place trials with --gpus"
                )
            d = replace(d, gpu_ids=_gpu_ids(gpus, "--gpus"))
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


_SEE = "see 'Writing a study' in docs/study-file.md"


def _engine(eng: Table, default_platform: str | None):
    """[engine]: (the command, the platform, the fixed args, the start-up timeout, declared GPUs, secret env names,
    the GPUs trials are placed on)."""
    model = eng.string("model")
    platform = eng.string("platform", default_platform or "cuda", choices=("cuda", "cpu"))
    args, env = eng.table("args"), eng.table("env")
    engine = EngineCommand(
        model=model,
        command=_command(eng),
        host=eng.string("host", "127.0.0.1"),
        port=eng.integer("port", 8100, at_least=1, at_most=65535),
        allow_trust_remote_code=eng.boolean("allow_trust_remote_code", False),
        # on a CPU host the engine and the replay client share the cores: the client goes first
        nice=eng.integer("nice", 10 if platform == "cpu" else 0, at_least=-20, at_most=19),
        kind=eng.string("kind", ""),
    )
    kind = engine.engine_kind  # an unknown kind is an error now, not at the first trial
    startup = eng.duration("startup_timeout", 900.0, above=0)
    gpus = _gpus(eng.table("gpu")) if "gpu" in eng else None
    secret_env = tuple(eng.strings("secret_env", []))
    gpu_ids = _gpu_ids(eng.string("gpus"), eng.name("gpus")) if "gpus" in eng else None
    eng.done()
    fixed = EngineArgs(dict(args.data), {key: env.text(key) for key in env})
    if gpu_ids and VISIBLE in fixed.env:
        raise ConfigError(
            f"{eng.name('gpus')} and {env.name(VISIBLE)} both say which GPUs the engine uses: keep one "
            f"({eng.name('gpus')} places each trial on its own GPUs of the list)"
        )
    for key, value in fixed.values.items():
        check_range(kind, key, value, args.name(key))
    return engine, platform, fixed, startup, gpus, secret_env, gpu_ids


def _gpu_ids(text: str, where: str) -> tuple[int, ...]:
    try:
        return parse_gpu_ids(text)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def _workload(wl: Table, p: Path, kind: EngineKind, fixed: EngineArgs, model: str) -> WorkloadSpec:
    """[workload]: a trace (relative to the study file) or a scenario, and what changes it."""
    where = p.name
    overrides: dict[str, object] = {
        key: _token_range(wl, key) for key in ("prompt_tokens", "output_tokens", "prefix_tokens") if key in wl
    }
    if "prefix_groups" in wl:
        overrides["prefix_groups"] = wl.integer("prefix_groups", at_least=1)
    trace = wl.string("trace", None)
    workload = WorkloadSpec(
        trace=(p.parent / trace) if trace else None,
        scenario=wl.string("scenario", None),
        rate=wl.number("rate", None, above=0),
        num_requests=wl.integer("requests", 200, at_least=1),
        burstiness=wl.number("burstiness", 1.0, above=0),
        seed=wl.integer("seed", 0),
        overrides=overrides,
        api=wl.string("api", None, choices=("completion", "chat")),
        tokenizer=_tokenizer(wl.string("tokenizer", None), kind, fixed.values, model),
        no_tokenizer=_no_tokenizer(model, kind.revision(fixed.values), where),
    )
    wl.done()
    if (workload.trace is None) == (workload.scenario is None):
        raise ConfigError(f"{where} [workload]: give either trace = FILE or scenario = NAME")
    return workload


def _objective(obj: Table) -> Objective:
    """[objective]: what a trial's score is, and how its loads are stepped."""
    objective = Objective(
        kind=obj.string("kind", "capacity", choices=SCORING_KINDS),
        start_load=obj.number("start_load", 1.0, above=0),
        max_steps=obj.integer("max_steps", 4, at_least=1),
        resolution=obj.number("resolution", 1.25, above=1),
        step_seconds=obj.duration("step_duration", None, above=0),
        race=obj.boolean("race", True),
        simulate_first=obj.boolean("simulate_first", True),
        cut_lost_steps=obj.boolean("cut_lost_steps", True),
        replay_workers=obj.integer("replay_workers", None, at_least=1),
    )
    obj.done()
    return objective


def load_study(
    path: str | Path, *, default_platform: str | None = None, default_runs_dir: Path | None = None
) -> StudyDefinition:
    """``default_runs_dir``: the runs_dir of a file that names none (else ``runs``, under the working directory);
    a file that names no storage keeps its Optuna storage there too (runs_dir/studies.db)."""
    p = Path(path)
    top = Table.of_file(p, "study file", see=_SEE)
    top.only(_TOP)
    where = p.name
    name = top.string("name", p.stem) or p.stem
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ConfigError(f"{where}: name {name!r} may only hold letters, digits, '.', '_' and '-'")

    engine, platform, fixed, startup, gpus, secret_env, gpu_ids = _engine(top.table("engine"), default_platform)
    kind, model = engine.engine_kind, engine.model

    params = None
    if "space" in top:
        space = top.table("space")
        if not space.keys():
            raise ConfigError(
                f"{space.where} is empty, so it would search nothing: name a parameter, "
                "or leave [space] out to search the engine's default space"
            )
        params = tuple(Param.from_table(k, space.value(k), space.name(k), kind) for k in space)

    workload = _workload(top.table("workload"), p, kind, fixed, model)

    slos = read_slos(top)

    objective = _objective(top.table("objective"))
    if objective.kind == "capacity" and not slos:
        raise ConfigError(f"{where}: the capacity objective needs at least one SLO (slos = ['ttft<800ms'] or --slo)")

    bud = top.table("budget")
    budget = Budget(trials=bud.integer("trials", 20, at_least=1), timeout_s=bud.duration("timeout", None, above=0))
    bud.done()

    bl = top.table("baselines")
    builtin = check_builtin(kind, bl.strings("builtin"), bl.name("builtin")) if "builtin" in bl else None
    baselines = _baselines(bl, params if params is not None else default_space(kind, platform), kind)
    bl.done()

    rm = top.table("remeasure")
    top_n, repeats = rm.integer("top", 2, at_least=0), rm.integer("repeats", 3, at_least=1)
    confidence = rm.number("confidence", CONFIDENCE, above=0.5, at_most=0.999)
    rm.done()

    d = StudyDefinition(
        name=name,
        command=engine,
        fixed=fixed,
        params=params,
        platform=platform,
        workload=workload,
        slos=slos,
        objective=objective,
        budget=budget,
        storage=top.string("storage", ""),
        sampler=top.string("sampler", "tpe", choices=("tpe", "random", "gp")),
        seed=top.integer("seed", None),
        baselines=baselines,
        builtin_baselines=builtin,
        precheck=top.boolean("precheck", True),
        remeasure_top=top_n,
        remeasure_repeats=repeats,
        remeasure_confidence=confidence,
        startup_timeout_s=startup,
        runs_dir=Path(top.string("runs_dir", str(default_runs_dir or "runs"))),
        source=p,
        gpus=gpus,
        gpu_ids=gpu_ids,
        heartbeat_s=top.duration("heartbeat", 60.0, above=0),
        secret_env=secret_env,
    )
    return d.with_overrides()


def read_slos(t: Table) -> list[SLO]:
    """A file's ``slos = ["ttft<800ms", ...]`` (study and daemon files alike), errors naming the file."""
    texts = t.strings("slos", [])
    try:
        return parse_slos(texts)
    except SLOSyntaxError as e:
        raise SLOSyntaxError(f"{t.name('slos')}: {e}") from None


def _command(eng: Table) -> tuple[str, ...]:
    text = eng.string("command", "vllm serve")
    try:
        return EngineCommand.parse_command(text)
    except ValueError as e:  # shlex: an unbalanced quote or a trailing backslash
        raise ConfigError(
            f"{eng.name('command')} must split like a shell line, got {show(text)} ({str(e).lower()})"
        ) from None
    except ConfigError as e:
        raise ConfigError(f"{eng.name('command')}: {e}") from None


def _token_range(wl: Table, key: str) -> tuple[int, int]:
    """``prompt_tokens = 128`` or ``[64, 256]``."""
    value = wl.value(key)
    pair = [value, value] if not isinstance(value, list) else value
    if (
        len(pair) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair)
        or not 0 <= pair[0] <= pair[1]
    ):
        raise wl.wrong(key, "N or [low, high] with 0 <= low <= high")
    return pair[0], pair[1]


def _baselines(bl: Table, searched: tuple[Param, ...], kind: EngineKind) -> tuple[Baseline, ...]:
    """``production = { ... }`` and ``extra = [{ name = ..., values = { ... } }]``, each value checked now
    against the parameter it sets (the space's, else the engine's default space) and the engine's ranges."""
    entries = bl.value("extra", [])
    if not isinstance(entries, list) or not all(
        isinstance(x, dict) and isinstance(x.get("name"), str) and isinstance(x.get("values"), dict) for x in entries
    ):
        raise ConfigError(f"{bl.name('extra')} entries are {{ name = ..., values = {{ ... }} }}")
    named = [(f"{bl.name('extra')}[{i}].values", Baseline(x["name"], dict(x["values"]))) for i, x in enumerate(entries)]
    if "production" in bl:
        named.insert(0, (bl.name("production"), Baseline("production", dict(bl.table("production").data))))
    params = {q.name: q for q in searched}
    for where, b in named:
        for key, value in b.values.items():
            if key in params and (expected := params[key].expects(value)) is not None:
                raise ConfigError(f"{where}.{key} must be {expected}, got {show(value)}")
            check_range(kind, key, value, f"{where}.{key}")
    return tuple(b for _, b in named)


def _tokenizer(given: str | None, kind: EngineKind, engine_args: Mapping[str, Value], model: str) -> Path | None:
    """Prompts are built with the tokenizer the engine counts with: the workload's, else the one the engine args
    name, else the model's (a directory, or the Hugging Face cache at the engine's revision)."""
    for candidate in (given, kind.tokenizer(engine_args)):
        if candidate and Path(candidate).exists():
            return Path(candidate)
    return locate(model, kind.revision(engine_args)).tokenizer


def _no_tokenizer(model: str, revision: str | None, where: str) -> str:
    """What to do when prompts need the model's tokenizer and it is not where vLLM would find the model."""
    files = locate(model, revision)
    key = f"set [workload].tokenizer = DIR (a directory with tokenizer.json) in {where}"
    if files.directory is not None:
        return f"{files.directory} holds no tokenizer.json: {key}"
    return f"{files.found}: {files.fetch_advice()}, or {key}"


def _gpus(t: Table) -> tuple[GpuInfo, ...]:
    """``[engine.gpu] name = "NVIDIA H100 80GB HBM3", memory = "79.6GiB", count = 1``: for an engine on
    devices NVML on this host cannot see (vllm-sim, a remote staging host)."""
    name = t.string("name")
    given, memory = t.value("memory"), 0
    if isinstance(given, str) or (isinstance(given, int) and not isinstance(given, bool)):
        with contextlib.suppress(ValueError):
            memory = parse_bytes(given)
    if memory <= 0:
        raise t.wrong("memory", 'a size like "80GiB" or a number of bytes')
    count = t.integer("count", 1, at_least=1)
    t.done()
    return tuple(GpuInfo(i, name, memory, memory) for i in range(count))


def derive_study(
    template: Path,
    out: Path,
    *,
    name: str,
    storage: str,
    runs_dir: Path,
    slos: list[str],
    trace: Path,
    tokenizer: Path | None,
    step_duration: str,
    baselines: dict[str, dict[str, Any]],
    engine_env: dict[str, str] | None = None,
    requests: int | None = None,
) -> Path:
    """Write a study file that is ``template`` with another name, workload, SLOs and baselines.

        The daemon's re-tuning studies are made this way: the staging study as the operator wrote it,
        production's traffic as the workload, production's config and earlier winners as baselines
        (``baselines``: name -> values; "production" becomes [baselines].production, the rest extra
        entries, replacing earlier extra entries of the same names); ``engine_env`` is set over
        [engine.env] (the GPUs a blue/green production leaves idle, one slot); a staging study that names no
    [engine] gpus runs one trial at a time on what the environment gives it ("inherit": beside production, the
    GPUs NVML sees are not all free); ``requests``: how many of the trace's
        requests a load step draws on (else the study's default, 200). The result is read back with
        ``load_study`` before it is returned, so a bad derivation fails here, not in a child process.
    """
    import tomli_w

    from autotune.locations import atomic_write

    data = read_toml(template, "study file")
    data.update(name=name, storage=storage, runs_dir=str(Path(runs_dir).resolve()), slos=list(slos))
    workload: dict[str, Any] = {"trace": str(Path(trace).resolve())}
    if tokenizer is not None:
        workload["tokenizer"] = str(Path(tokenizer).resolve())
    if requests is not None:
        workload["requests"] = requests
    data["workload"] = workload
    data.setdefault("objective", {}).setdefault("step_duration", step_duration)
    engine = data.setdefault("engine", {})
    if engine_env:
        engine.setdefault("env", {}).update(engine_env)
        if VISIBLE in engine_env:
            engine.pop("gpus", None)  # the GPUs it is given, as one slot
    elif "gpus" not in engine:
        engine["gpus"] = INHERIT  # beside production: one trial at a time, unless the staging study names its GPUs
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
