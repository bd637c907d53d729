"""The ``autotune`` command.

    autotune bench  --model DIR --scenario chat --rate 4 --slo 'ttft<800ms' -- --max-num-seqs 64
    autotune replay --url http://127.0.0.1:8000 --workload trace.jsonl --slo 'p99:tpot<50ms'

Exit codes: 0 every SLO holds; 1 an SLO misses (or the engine failed); 2 bad usage.
Subcommands import what they need when they run, so `autotune --help` does not load Optuna or numpy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune import __version__
from autotune.boundary import input_errors, one_line
from autotune.cli.conventions import (
    EXIT_OK,
    EXIT_SLO_MISS,
    EXIT_USAGE,
    SLO_HELP,
    Parser,
    default_engine_command,
    port,
    stopped,
    whole_number,
)
from autotune.errors import AutotuneError, ConfigError, Interrupted

if TYPE_CHECKING:
    from autotune.measure.replay import ReplayOptions
    from autotune.workload.options import WorkloadOptions
    from autotune.workload.source import WorkloadSpec
    from autotune.workload.trace import Workload


def _add_workload(p: argparse.ArgumentParser) -> None:
    """The workload and replay flags (workload/options.py, which ``vllm-sim predict`` shares), and the verdict's."""
    from autotune.workload.options import add_arguments

    add_arguments(p)
    p.add_argument("--slo", action="append", default=[], help=SLO_HELP)
    p.add_argument("--json", type=Path, help="write the full result as JSON here")
    p.add_argument("--requests-json", type=Path, help="write every request's timings (JSONL) here")


def _add_daemon_parsers(sub) -> None:
    """``autotune daemon`` and the commands that talk to a running one through its config."""
    dm = sub.add_parser(
        "daemon",
        help="watch production, re-tune on drift, publish safely (a systemd service)",
        description="Run the long-lived loop a daemon config defines (docs/daemon.md "
        "documents every key). --check checks what it needs and runs nothing; SIGHUP re-reads "
        "the config.",
    )
    dm.add_argument("--config", type=Path, required=True, help="daemon config, e.g. /etc/autotune/daemon.toml")
    dm.add_argument(
        "--check",
        action="store_true",
        help="check everything the daemon will need (production, its config and restart command, the "
        "staging study, state and metrics), print one line per problem, run nothing",
    )
    for name, text in (
        ("retune", "ask the running daemon to tune now (it starts within one scrape interval)"),
        ("status", "the daemon's state and its publish history"),
        ("history", "the daemon's publish history: each entry, its changes, the proposal's diff"),
        ("publish", "publish the daemon's waiting proposal (approval mode), or reject it"),
        ("rollback", "put production back on an earlier good config, by hand"),
    ):
        q = sub.add_parser(name, help=text)
        q.add_argument("--config", type=Path, required=True, help="the daemon's config file")
        if name == "retune":
            q.add_argument("--reason", default="by hand")
        if name == "publish":
            g = q.add_mutually_exclusive_group(required=True)
            g.add_argument(
                "--approve",
                action="store_true",
                help="hand it to the daemon to deploy (canary, rollback on failure) and wait for the outcome",
            )
            g.add_argument("--reject", action="store_true", help="drop it; production stays as it is")
            q.add_argument("--no-wait", action="store_true", help="return once the approval is recorded")
            q.add_argument("--timeout", type=float, help="seconds to wait for the outcome (default 1800)")
        if name == "rollback":
            q.add_argument("--to", type=int, help="history entry to restore (default: the good one before)")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="autotune", description="Tune vLLM engine args against your workload and SLOs.")
    p.add_argument("--version", action="version", version=f"autotune {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    b = sub.add_parser(
        "bench",
        help="start vLLM with given args, replay a workload, judge the SLOs",
        description="Start the engine, warm up, replay the workload, stop the engine, judge the "
        "SLOs. Engine args follow '--', e.g. -- --max-num-seqs 64 --enable-chunked-prefill",
    )
    b.add_argument("--model", required=True, help="model path or name, passed to the engine")
    b.add_argument("--engine-cmd", default=None, help="engine command line prefix (default: 'vllm serve')")
    b.add_argument("--host", default="127.0.0.1", help="engine bind address (default 127.0.0.1)")
    b.add_argument("--port", type=port, default=8100)
    b.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="engine environment, repeatable")
    b.add_argument("--startup-timeout", type=float, default=900.0)
    b.add_argument("--log-dir", type=Path, default=Path("runs/bench"), help="engine logs (default runs/bench)")
    b.add_argument("--vllm-version", help="flag table to check against when vLLM's parser cannot be run")
    b.add_argument("--allow-trust-remote-code", action="store_true")
    b.add_argument(
        "--engine-nice",
        type=int,
        default=0,
        help="lower the engine's CPU priority (e.g. 10) when it shares a CPU host with the replay client",
    )
    _add_workload(b)

    from autotune.cli.calibrate import add_parser as add_calibrate
    from autotune.cli.study import add_parsers

    add_parsers(sub)
    add_calibrate(sub)

    _add_daemon_parsers(sub)

    cp = sub.add_parser("capture", help="a recording proxy: forward to production, write a trace of its traffic")
    cp.add_argument(
        "--listen", default="127.0.0.1:8001", help="HOST:PORT to accept clients on (default 127.0.0.1:8001)"
    )
    cp.add_argument("--upstream", required=True, help="production's base URL, e.g. http://127.0.0.1:8000")
    cp.add_argument("--out", type=Path, required=True, help="trace file to append to (autotune JSONL)")
    cp.add_argument("--with-prompts", action="store_true", help="also record prompt text (off: token counts only)")

    rp = sub.add_parser("replay", help="replay a workload against a running server and judge the SLOs")
    rp.add_argument("--url", required=True, help="base URL of an OpenAI-compatible server")
    rp.add_argument("--model", help="served model name (default: the first in /v1/models)")
    rp.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    _add_workload(rp)
    return p


def _split_engine_args(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def _env_pairs(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--env {item!r} must be KEY=VALUE")
        env[key] = value
    return env


def _load_workload(spec: WorkloadSpec) -> Workload:
    """The workload; a note on stderr says what its file left out (ShareGPT conversations without an exchange)."""
    from autotune.workload.source import load
    from autotune.workload.trace import SKIPPED_WHY

    workload = load(spec)
    if workload.skipped:
        print(
            f"autotune: note: {spec.trace}: skipped {workload.skipped} conversations ({SKIPPED_WHY})", file=sys.stderr
        )
    return workload


def _replay_options(options: WorkloadOptions, model: str | None = None, api_key: str | None = None) -> ReplayOptions:
    from autotune.measure.replay import ReplayOptions

    return ReplayOptions(
        load=options.load,
        max_concurrency=options.max_concurrency,
        request_timeout_s=options.request_timeout,
        warmup_requests=options.warmup,
        workers=options.workers,
        model=model,
        api_key=api_key,
    )


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from autotune.console import err

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    )


def _finish(result, a: argparse.Namespace) -> int:
    from autotune.console import print_result
    from autotune.engine.failures import FailureClass

    print_result(result)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    if a.requests_json:
        a.requests_json.parent.mkdir(parents=True, exist_ok=True)
        a.requests_json.write_text("".join(json.dumps(r) + "\n" for r in result.requests_json()))
    if result.failure is not None and result.failure.failure_class is FailureClass.INVALID_ARGS:
        # bad usage caught by the engine, not by our own flag check: the same one line and exit 2
        print(f"autotune: the engine refused its args: {result.failure.summary}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK if result.slos_hold else EXIT_SLO_MISS


def cmd_bench(a: argparse.Namespace, engine_args: list[str], measure_engine: Callable[..., Any] | None = None) -> int:
    from autotune.engine.args import EngineArgs
    from autotune.engine.command import EngineCommand
    from autotune.engine.launcher import stop_on_signals
    from autotune.engine.model import locate
    from autotune.measure import session
    from autotune.measure.profiles import FixedLoad
    from autotune.measure.slo import parse_slos
    from autotune.workload.options import WorkloadOptions

    slos = parse_slos(a.slo)
    command = EngineCommand(
        model=a.model,
        command=EngineCommand.parse_command(a.engine_cmd or default_engine_command()),
        host=a.host,
        port=a.port,
        allow_trust_remote_code=a.allow_trust_remote_code,
        nice=a.engine_nice,
    )
    table = command.flag_table(a.vllm_version)
    args = EngineArgs.from_cli(engine_args, table, _env_pairs(a.env))
    checked = command.check(args, table)  # before the workload is read: bad args are a usage error
    # where vLLM would find the model: its tokenizer too
    files = locate(a.model, command.engine_kind.revision(args.values))
    options = WorkloadOptions.from_args(a)  # the flags' numbers, checked before anything is read or started
    spec = options.spec(
        options.tokenizer or files.tokenizer,
        no_tokenizer=f"{files.found}: pass --tokenizer DIR (a directory with tokenizer.json), or "
        f"{files.fetch_advice()}",
    )
    workload = _load_workload(spec)
    stop_on_signals()  # SIGTERM and SIGHUP stop the engine as Ctrl-C does
    try:
        with _progress() as progress:
            task = progress.add_task("starting engine", total=len(workload))
            result = (measure_engine or session.measure_engine)(
                command,
                checked,
                lambda _: workload,
                slos,
                FixedLoad(),
                log_dir=a.log_dir,
                startup_timeout=a.startup_timeout,
                replay=_replay_options(options),
                on_phase=lambda ph: progress.update(task, description=ph),
                on_result=lambda _: progress.advance(task),
            )
    except Interrupted as e:
        return stopped(e, "; the engine was stopped")
    return _finish(result, a)


def cmd_replay(a: argparse.Namespace, measure_url: Callable[..., Any] | None = None) -> int:
    from autotune.measure import session
    from autotune.measure.slo import parse_slos
    from autotune.workload.options import WorkloadOptions

    slos = parse_slos(a.slo)
    options = WorkloadOptions.from_args(a)
    workload = _load_workload(options.spec(options.tokenizer))
    with _progress() as progress:
        task = progress.add_task("replaying", total=len(workload))
        result = (measure_url or session.measure_url)(
            a.url.rstrip("/"),
            lambda _: workload,
            slos,
            _replay_options(options, a.model, a.api_key),
            on_result=lambda _: progress.advance(task),
        )
    return _finish(result, a)


def cmd_capture(a: argparse.Namespace) -> int:
    from autotune.workload.capture import run_capture

    host, _, port = a.listen.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # [::1]:8001
    if not host or whole_number(port, 1, 65535) is None:
        raise ConfigError(f"--listen must be HOST:PORT with a port from 1 to 65535, got {a.listen!r}")

    def listening(_: int) -> None:  # said once it listens: a refusal before that is the only line
        print(f"autotune: capturing {a.upstream} on http://{a.listen} into {a.out} (Ctrl-C stops)", file=sys.stderr)

    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a capture ends
        run_capture(host, int(port), a.upstream, a.out, with_prompts=a.with_prompts, on_ready=listening)
    return EXIT_OK


def main(
    argv: list[str] | None = None,
    *,
    measure_engine: Callable[..., Any] | None = None,
    measure_url: Callable[..., Any] | None = None,
) -> int:
    """Run one command; its exit status. ``measure_engine`` and ``measure_url`` stand in for measure/session.py's
    (``bench``, ``replay``), as httpx takes a transport: a test that must start nothing passes its own."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, engine_args = _split_engine_args(argv)
    parser = build_parser()
    a = parser.parse_args(ours)
    if a.command is None:
        parser.print_help()
        print("autotune: give a command, e.g. autotune replay --help", file=sys.stderr)
        return EXIT_USAGE
    if engine_args and a.command != "bench":
        parser.error(f"engine args after '--' only go with bench, not {a.command}")
    try:
        with input_errors():  # what a library raises because of the input: a ConfigError (boundary.py)
            if a.command == "bench":
                return cmd_bench(a, engine_args, measure_engine)
            from autotune.cli import calibrate, daemon, study

            handler = {
                "study": study.cmd_study,
                "init": study.cmd_init,
                "dashboard": study.cmd_dashboard,
                "report": study.cmd_report,
                "daemon": daemon.cmd_daemon,
                "retune": daemon.cmd_retune,
                "status": daemon.cmd_status,
                "publish": daemon.cmd_publish,
                "rollback": daemon.cmd_rollback,
                "history": daemon.cmd_history,
                "calibrate": calibrate.cmd_calibrate,
                "capture": cmd_capture,
            }.get(a.command)
            if handler is not None:
                return handler(a)
            return cmd_replay(a, measure_url)
    except AutotuneError as e:  # ConfigError: exit 2; anything else we raise on purpose: exit 1
        print(f"autotune: {one_line(str(e))}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("autotune: interrupted; the engine was stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
