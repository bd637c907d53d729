"""The study's commands: ``autotune study`` (with a file, or from a few flags), ``init``, ``report``, ``dashboard``."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from autotune.cli.conventions import (
    EXIT_OK,
    EXIT_SLO_MISS,
    SLO_HELP,
    default_engine_command,
    invoked,
    port,
    stopped,
    trial_count,
)
from autotune.errors import AutotuneError, ConfigError, Interrupted

__all__ = ["add_parsers", "cmd_study", "cmd_init", "cmd_report", "cmd_dashboard"]


def _add_request(p: argparse.ArgumentParser, *, for_init: bool) -> None:
    """The flags a study can be made from, without a file."""
    g = p.add_argument_group("a study without a file" if not for_init else "the study")
    g.add_argument(
        "--model",
        help="as vllm serve takes it: a directory, or a Hugging Face id found in the Hugging "
        "Face cache (its config.json sizes the space, its tokenizer builds prompts)",
    )
    g.add_argument("--workload", type=Path, help="recorded traffic: autotune JSONL, vllm bench custom JSONL, ShareGPT")
    g.add_argument("--scenario", help="synthetic traffic: chat (default), long-docs or high-concurrency")
    g.add_argument(
        "--rate", type=float, help="requests/s of the synthetic traffic; each trial's load ladder starts here"
    )
    g.add_argument("--requests", type=int, default=200, help="requests per synthetic workload (default 200)")
    g.add_argument("--tokenizer", type=Path, help="tokenizer directory when the model's own is not at hand")
    g.add_argument(
        "--download",
        action="store_true",
        help="fetch the model's config.json and tokenizer (not its "
        "weights) into the Hugging Face cache when they are not there (huggingface_hub; HF_TOKEN applies)",
    )
    g.add_argument("--engine-cmd", help="engine command line prefix (default: 'vllm serve')")
    g.add_argument("--port", type=port, default=8100, help="staging engine port on localhost (default 8100)")
    p.add_argument(
        "--slo",
        action="append",
        default=[],
        help=SLO_HELP + ("" if for_init else "; with a file, replaces the file's SLOs"),
    )
    p.add_argument("--trials", type=int, help="trials in the study in all, baselines included (default 20)")
    p.add_argument("--study-name", help="name of the study (default: the model's and the traffic's names)")


def add_parsers(sub) -> None:
    st = sub.add_parser(
        "study",
        help="search engine args for the most load within the SLOs (Optuna)",
        description="Run (or resume) a study. Without a file: autotune study --model DIR --slo 'ttft<800ms' --rate 4 "
        "writes runs/<name>/study.toml (every default spelled out) and runs it. With a file: the file's study, "
        "flags on top.",
    )
    st.add_argument("file", type=Path, nargs="?", help="study definition, e.g. studies/tiny-cpu-chat.toml")
    _add_request(st, for_init=False)
    st.add_argument("--timeout", help="stop starting trials after this long, e.g. 2h")
    st.add_argument(
        "--gpus",
        help="the GPUs trials run on, side by side, each on GPUs of its own (NVML indices, e.g. 0-7 or 0,2,4-5; "
        "default: [engine] gpus, else every GPU NVML sees)",
    )
    st.add_argument("--storage", help="Optuna storage URL (default: sqlite in the study's runs dir)")
    st.add_argument(
        "--dry-run",
        type=trial_count,
        nargs="?",
        const=5,
        metavar="N",
        help="print the first N trials' argv and env as JSON lines, launch nothing",
    )
    st.add_argument("--no-remeasure", action="store_true", help="skip re-measuring the top candidates")
    st.add_argument(
        "--json",
        action="store_true",
        dest="json_lines",
        help="print one JSON object per trial and one for the result, nothing else, on stdout",
    )

    it = sub.add_parser(
        "init",
        help="write an annotated study file from a few flags, run nothing",
        description="Write the study `autotune study --model ... --slo ...` would run, every "
        "default spelled out with a comment, to edit before running it.",
    )
    _add_request(it, for_init=True)
    it.add_argument("--out", type=Path, help="file to write (default: runs/<name>/study.toml, as without a file)")
    it.add_argument("--force", action="store_true", help="overwrite --out if it exists")

    for name, text in (
        ("dashboard", "open the study in optuna-dashboard"),
        ("report", "write an HTML report of the study"),
    ):
        q = sub.add_parser(name, help=text)
        q.add_argument("file", type=Path, help="study definition")
        q.add_argument("--storage", help="Optuna storage URL (default: the study's)")
        q.add_argument("--study-name")
        if name == "dashboard":
            q.add_argument("--host", default="127.0.0.1")
            q.add_argument("--port", type=port, default=8080)
        else:
            q.add_argument("--out", type=Path, help="HTML file (default: runs/<study>/report.html)")


def _request(a: argparse.Namespace):
    from autotune.measure.slo import parse_slos
    from autotune.study.starter import StudyRequest

    if not a.model:
        raise ConfigError(
            "give a study file, or the model to tune: --model DIR --slo 'ttft<800ms' --rate R (autotune study --help)"
        )
    if a.requests < 1:
        raise ConfigError("--requests must be at least 1")
    if a.download:
        from autotune.engine.model import locate

        files = locate(a.model, download=True)
        if files.directory is None:
            raise ConfigError(files.found)
        print(f"autotune: {files.found}", file=sys.stderr)
    return StudyRequest(
        model=a.model,
        slos=tuple(parse_slos(a.slo)),  # the one parse of the flags: a typo is its own one-line error
        engine_command=a.engine_cmd or default_engine_command(),
        workload=a.workload,
        scenario=a.scenario,
        rate=a.rate,
        requests=a.requests,
        tokenizer=a.tokenizer,
        trials=a.trials if a.trials is not None else 20,
        name=a.study_name,
        port=a.port,
    )


def _platform(command: str):
    """The GPUs the study tunes for: the engine command's own (vllm-sim --gpu), else NVML's, else the CPU."""
    from autotune.engine import gpu
    from autotune.engine.command import EngineCommand
    from autotune.engine.kind import kind_for_command
    from autotune.study.starter import Platform

    argv = EngineCommand.parse_command(command)
    declared = kind_for_command(argv).devices(argv)
    if declared:
        return Platform("cuda", tuple(declared), declared=True)
    seen = gpu.devices()
    return Platform("cuda" if seen else "cpu", tuple(seen), declared=False)


def _render(a: argparse.Namespace, out: Path | None = None) -> tuple[str, Path, str]:
    """(name, where the file goes: ``out`` or runs/<name>/study.toml, the study file's text) for the flags given,
    every flag checked before anything is written."""
    from autotune.engine.command import EngineCommand
    from autotune.engine.kind import kind_for_command
    from autotune.study.starter import check_request, default_path, render_study, study_name

    req = _request(a)
    check_request(req)
    platform = _platform(req.engine_command)
    kind = kind_for_command(EngineCommand.parse_command(req.engine_command))
    g = platform.gpus[0] if platform.gpus else None
    space = kind.default_space(platform.name, g.total_bytes / (1 << 30) if g else 0.0, g.name if g else "")
    if platform.name == "cpu":
        print(
            "autotune: note: no NVIDIA GPU is visible to NVML here, so the study tunes vLLM's CPU backend; to "
            "tune for a GPU this host cannot see, add [engine.gpu] (name, memory, count) to the study file",
            file=sys.stderr,
        )
    path = out or default_path(req)
    return study_name(req), path, render_study(req, platform, space, kind.tokenizer_arg, path)


def cmd_init(a: argparse.Namespace) -> int:
    from autotune.locations import atomic_write
    from autotune.study.starter import validated

    _, out, text = _render(a, a.out)
    text = validated(text)
    if out.exists() and not a.force:
        raise ConfigError(f"{out} exists: give another --out, or --force to overwrite it")
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, text)
    print(f"wrote {out}; run it with: {invoked()} study {out}")
    return EXIT_OK


def _file_free_study(a: argparse.Namespace):
    """Write runs/<name>/study.toml for the flags (or find the same one from an earlier run): (its path, the
    study it holds, loaded once)."""
    from autotune.locations import atomic_write

    name, path, text = _render(a)
    if path.is_file() and path.read_text(encoding="utf-8") != text:
        raise ConfigError(
            f"{path} holds another study named {name} (other flags): resume it with "
            f"`{invoked()} study {path}`, or name this one with --study-name"
        )
    fresh = not path.is_file()
    atomic_write(path, text)
    try:
        d = _load(path)  # the file's one parse; it always loads (a bug otherwise): leave no broken file behind
    except AutotuneError:
        if fresh:
            path.unlink()
        raise
    said = "wrote" if fresh else "resuming"
    print(f"autotune: {said} {path}; edit it, or rerun and resume with: {invoked()} study {path}", file=sys.stderr)
    return path, d


def _load(path: Path):
    from autotune.engine import gpu
    from autotune.study.definition import load_study

    return load_study(path, default_platform="cuda" if gpu.devices() else "cpu")


def load_definition(a: argparse.Namespace):
    d = _load(a.file)
    return d.with_overrides(
        slos=getattr(a, "slo", None),
        trials=getattr(a, "trials", None),
        timeout=getattr(a, "timeout", None),
        storage=a.storage,
        name=a.study_name,
        gpus=getattr(a, "gpus", None),
    )


def cmd_study(a: argparse.Namespace) -> int:
    from autotune.console import StudyView, print_comparison, print_pareto
    from autotune.engine.launcher import stop_on_signals
    from autotune.study.outputs import comparison, write_verdict
    from autotune.study.records import StudyResult, TrialRecord
    from autotune.study.runner import StudyRun, study_advisor
    from autotune.study.storage import open_study
    from autotune.workload.source import LoadSteps

    if a.file is None:
        a.file, d = _file_free_study(a)
        d = d.with_overrides(timeout=a.timeout, storage=a.storage, gpus=a.gpus)  # the file holds the other flags
    elif a.model or a.workload or a.scenario or a.rate or a.tokenizer or a.engine_cmd or a.download:
        raise ConfigError(f"give a study file or --model and its flags, not both: edit {a.file} instead")
    else:
        d = load_definition(a)
    table = d.command.flag_table()
    if a.dry_run is not None:
        return _dry_run(d, table, a.dry_run)
    steps = LoadSteps(d.workload, d.objective.step_seconds)
    stop_on_signals()  # SIGTERM and SIGHUP stop the engine as Ctrl-C does; the study stays resumable
    # the top candidates and the best baseline, each run again (at most: fewer candidates may have held the SLOs)
    remeasured = d.objective.scoring().remeasured and not a.no_remeasure
    runs = (d.remeasure_top + 1) * d.remeasure_repeats if remeasured else 0
    # the view first: it routes Optuna's log lines (the study's creation included) into the study's log
    with StudyView(
        d.name,
        d.budget.trials,
        d.run_dir / "study.log",
        gpu=d.platform == "cuda",
        json_lines=a.json_lines,
        remeasure_runs=runs,
    ) as view:
        study = open_study(d)
        advisor, why_not = study_advisor(d, steps)
        run = StudyRun.on_engine(d, table, steps, show=view.show, notice=view.notice, advisor=advisor)
        view.notice(d.model_files().found)
        if advisor.predicts:
            view.notice(f"simulating first with {advisor.describe}")
        elif why_not and d.objective.simulate_first:
            view.notice(f"not simulating first: {why_not}")
        run.callbacks = [lambda study, trial: view.trial_done(TrialRecord.of(trial), StudyResult.of(study))]
        try:
            run.optimize(study)
            # a rerun of a finished study keeps its verdict (StudyResult reads it while it is fresh)
            if StudyResult.of(study).remeasurement is None and not a.no_remeasure and run.scoring.remeasured:
                run.remeasure(study)
            run.advice.finish(study)  # what the advisor learns from the whole study, for the next one here
        except Interrupted as e:
            n = run.interrupted_trial(study)
            during = f" during trial {n} (recorded as failed)" if n is not None else ""
            return stopped(e, f"{during}; the engine was stopped. Rerun the same command to resume study {d.name}.")
    result = StudyResult.of(study)
    kind = d.command.engine_kind
    winner = None if result.pareto else result.winner
    paths = write_verdict(result, d.command.model, kind, d.run_dir, real_env=d.fixed.env, version=table.version)
    leader = result.leader if winner else None
    if a.json_lines:
        print(json.dumps(_result_event(result, winner, paths)))
    elif result.pareto:
        print_pareto(result.front)
    else:
        print_comparison(comparison(result, winner), result.remeasurement)
    if result.pareto:
        return EXIT_OK if result.front else EXIT_SLO_MISS
    if winner is None:
        print(f"autotune: no trial met every SLO; see why: {invoked()} report {a.file}", file=sys.stderr)
        return EXIT_SLO_MISS
    if not a.json_lines:
        _print_files(paths, kind, leader, a.file)
    return EXIT_OK


def _dry_run(d, table, trials: int) -> int:
    """The first trials' command lines as JSON lines, every error before any output; nothing starts."""
    from autotune.study.dryrun import dry_run
    from autotune.study.runner import study_advisor
    from autotune.workload.source import LoadSteps, read
    from autotune.workload.source import check as check_workload

    prompts = check_workload(d.workload, build_prompts=False)
    lines = list(dry_run(d, table, trials))  # every error before any output
    print(f"autotune: {d.model_files().found}", file=sys.stderr)
    if not prompts:
        print(
            "autotune: note: a dry run builds no prompts; the study will, with the model's tokenizer: "
            f"{d.workload.no_tokenizer}",
            file=sys.stderr,
        )
    for line in lines:
        print(json.dumps(line))
    # what the real study will do here, decided as it decides it (a dry run predicts nothing itself)
    advisor, why_not = study_advisor(d, LoadSteps.of(read(d.workload), d.objective.step_seconds or 1.0))
    if advisor.predicts:
        print(
            f"autotune: the real study simulates first with {advisor.describe}: the baselines and the simulator's "
            "picks then run in the order of their predicted capacity, which a dry run does not compute",
            file=sys.stderr,
        )
    elif why_not and d.objective.simulate_first:
        print(f"autotune: the real study will not simulate first: {why_not}", file=sys.stderr)
    return EXIT_OK


def _print_files(paths: dict[str, Path], kind, leader, file: Path) -> None:
    """Where the winner's files are, the leader kept beside them, and where the whole story is."""
    from autotune.study.outputs import NOT_RECOMMENDED

    if "config" in paths:
        print(
            f"best config: {paths['config']} ({kind.config_usage}), command line: {paths['command']}"
            + (f", container: {paths['docker']}" if "docker" in paths else "")
        )
    else:
        print(f"best config: command line {paths['command']}, values {paths['json']}")
    if leader is not None:
        print(
            f"not recommended (it led within the noise): trial {leader.number}, kept as "
            f"{paths[f'{NOT_RECOMMENDED}-json'].with_suffix('.*')}"
        )
    me = invoked()
    print(f"the whole story: {me} report {file}  (or {me} dashboard {file})")


def _result_event(result, winner, paths: dict[str, Path]) -> dict:
    """The study's outcome for machines: the winner, its gain over the best baseline, the verdict, the files."""
    base = result.best_baseline
    verdict = result.remeasurement
    return {
        "event": "result",
        "pareto": result.pareto,
        "front": [r.number for r in result.front] if result.pareto else None,
        "winner": None
        if winner is None
        else {
            "trial": winner.number,
            "label": winner.label,
            "params": winner.params,
            "capacity_rps": winner.capacity_rps,
        },
        "best_baseline": None if base is None else {"label": base.label, "capacity_rps": base.capacity_rps},
        "gain": (winner.capacity_rps / base.capacity_rps - 1) if winner is not None and base is not None else None,
        "remeasurement": None if verdict is None else {k: v for k, v in verdict.to_json().items() if k != "candidates"},
        "files": {k: str(v) for k, v in paths.items()},
    }


def cmd_dashboard(a: argparse.Namespace) -> int:
    d = load_definition(a)
    exe = shutil.which("optuna-dashboard") or str(Path(sys.executable).parent / "optuna-dashboard")
    if not Path(exe).exists() and not shutil.which(exe):
        raise ConfigError(
            "optuna-dashboard is not installed (autotune depends on it): reinstall autotune, e.g. pip install -e ."
        )
    argv = [exe, d.storage, "--host", a.host, "--port", str(a.port), "--artifact-dir", str(d.run_dir / "artifacts")]
    print(f"autotune: optuna-dashboard on http://{a.host}:{a.port} (Ctrl-C stops it)", file=sys.stderr, flush=True)
    sys.stdout.flush()
    # Become optuna-dashboard (same pid): SIGTERM from systemd, a container runtime or a test's terminate()
    # reaches the server itself, and no child is left behind when this process goes.
    try:
        os.execv(exe, argv)  # returns only by raising
    except OSError as e:
        raise ConfigError(f"cannot run {exe}: {e.strerror}") from e


def require_study(d, file: Path) -> None:
    """A report reads a study a run made: no such study is an error naming what there is, and leaves no
    empty database behind (opening a sqlite URL creates its file)."""
    import optuna

    if d.storage.startswith("sqlite:///"):
        path = Path(d.storage.removeprefix("sqlite:///").partition("?")[0])
        if not path.is_file():
            raise ConfigError(f"no study database at {path}: run `{invoked()} study {file}` first, or give --storage")
    names = sorted(optuna.get_all_study_names(d.storage))
    if d.name not in names:
        held = (
            f"it holds {', '.join(names)} (--study-name picks one)"
            if names
            else f"run `{invoked()} study {file}` first"
        )
        raise ConfigError(f"no study {d.name!r} in {d.storage}; {held}")


def cmd_report(a: argparse.Namespace) -> int:
    from autotune.study.report import write_report

    d = load_definition(a)
    require_study(d, a.file)
    out = write_report(d, a.out or d.run_dir / "report.html")
    print(f"report: {out}")
    return EXIT_OK
