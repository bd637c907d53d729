"""The daemon's commands: ``autotune daemon`` and what an operator runs beside it (status, retune, publish,
rollback)."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from autotune.cli.conventions import EXIT_OK, EXIT_SLO_MISS
from autotune.errors import ConfigError

__all__ = ["cmd_daemon", "cmd_retune", "cmd_status", "cmd_history", "cmd_publish", "cmd_rollback"]


def cmd_daemon(a: argparse.Namespace) -> int:
    import threading

    from autotune.daemon.config import load_daemon_config
    from autotune.daemon.loop import Daemon

    if a.check:
        return _check(a.config)
    daemon = Daemon(load_daemon_config(a.config, serving=True))  # its metrics port must be free now
    stop, reload = threading.Event(), threading.Event()
    received: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:  # only notes it: the loop acts after its tick
        if signum == signal.SIGHUP:  # systemctl reload: re-read the config, a running trial goes on
            reload.set()
            return
        received.append(signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    rc = daemon.run(stop, reload)
    if received:
        print(f"autotune: daemon stopped by {signal.Signals(received[0]).name}", file=sys.stderr)
    return rc


def _check(path: Path) -> int:
    """One line per problem on stderr and exit 1; a line saying so and exit 0 when there is none."""
    from autotune.daemon.check import check_daemon
    from autotune.daemon.config import load_daemon_config

    results = check_daemon(load_daemon_config(path))  # a file that does not load: its one line, exit 2
    problems = [(name, why) for name, why in results if why]
    for name, why in problems:
        print(f"autotune: {path}: {name}: {why}", file=sys.stderr)
    if problems:
        return EXIT_SLO_MISS
    print(f"autotune: {path}: all {len(results)} checks pass ({', '.join(name for name, _ in results)})")
    return EXIT_OK


def _daemon_parts(a: argparse.Namespace, *, need_state: bool = True):
    """The daemon's config, the directory its daemon keeps its state in (found from the config, whatever
    this environment's state directory is), its state store and history. With ``need_state``, a
    ConfigError (one line) when no daemon has kept state there yet."""
    from autotune.daemon.config import load_daemon_config
    from autotune.daemon.production import find_daemon_root, has_state
    from autotune.daemon.state import StateStore
    from autotune.publish.history import History

    cfg = load_daemon_config(a.config)
    root, looked = find_daemon_root(cfg)
    if need_state and not has_state(root):
        raise ConfigError(_no_state(cfg, looked))
    return cfg, root, StateStore(root), History(root / "history")


def _no_state(cfg, looked) -> str:
    where = " nor ".join(str(p) for p in looked)
    how = (
        "start it with this config"
        if cfg.state_dir is not None
        else f"start it with this config, or name the directory it keeps its state in with state_dir in {cfg.source}"
    )
    return f"no daemon named {cfg.name!r} has kept state in {where} yet: {how}"


def _pending_why(cfg, st) -> str:
    """Why a retune request has not started a tuning yet, in words."""
    import datetime as dt

    from autotune.daemon.state import Phase

    if st.phase is not Phase.WATCHING:
        return f"the daemon is {st.phase.value.replace('_', ' ')}; it takes the request once it watches again"
    if not cfg.may_tune_at(dt.datetime.now()):
        return f"outside the tuning windows ({cfg.windows_text()}); it starts when one opens"
    if "full window of traffic" in st.note:
        return "waiting for a full window of production's traffic to imitate"
    return f"the daemon takes it within one scrape interval ({cfg.scrape_interval_s:g} s)"


def cmd_retune(a: argparse.Namespace) -> int:
    from autotune.daemon.production import has_state
    from autotune.daemon.state import Phase

    cfg, root, store, _ = _daemon_parts(a, need_state=False)
    st = store.load()
    if st.phase is Phase.TUNING:
        # one tuning answers a request: one asked while a tuning runs would otherwise start on the traffic after it
        print(
            f"autotune: a tuning is running ({st.study_name}, {st.trigger}): it answers this request, so none is "
            "queued; `autotune status` follows it, and a retune asked once it ends starts another"
        )
        return EXIT_OK
    store.request_retune(a.reason)
    if not has_state(root):  # a daemon started later with this config reads it there
        print(f"autotune: note: {_no_state(cfg, [root])}; the request waits for it in {root}", file=sys.stderr)
    print(
        f"autotune: retune requested ({a.reason}); pending: {_pending_why(cfg, store.load())} "
        "(a request skips the cooldown; autotune status shows it)"
    )
    return EXIT_OK


def cmd_status(a: argparse.Namespace) -> int:
    from autotune.console import print_history

    cfg, root, store, history = _daemon_parts(a)
    st = store.load()
    print(f"phase: {st.phase.value} since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(st.since))}")
    print(f"note: {st.note}")
    if st.last_decision:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(st.last_decision_at))
        print(f"last decision: {when}: {st.last_decision}")
    print(f"state: {root}")
    request = store.retune_request()
    if request is not None:
        print(f"retune: requested ({request}), pending: {_pending_why(cfg, st)}")
    if st.scrape_error:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(st.scrape_error_at))
        print(f"production scrape: {'failing' if st.scrape_failing else 'ok'}; last error at {when}: {st.scrape_error}")
    print_history(history.entries())
    return EXIT_OK


def cmd_history(a: argparse.Namespace) -> int:
    from autotune.console import print_history

    _, _, _, history = _daemon_parts(a)
    print_history(history.entries())
    return EXIT_OK


APPROVAL_WAIT_S = 1800.0  # how long `publish --approve` waits for the daemon: a restart, a health wait, a canary
POLL_S = 1.0


def cmd_publish(a: argparse.Namespace) -> int:
    """``--reject`` settles the proposal here. ``--approve`` records the approval in the daemon's state directory
    and the daemon publishes on its own loop (publishing, verifying, a rollback if it fails: its phases and its
    journal show it); this command waits for the outcome in the history and prints it (``--no-wait``: at once)."""
    from autotune.publish.transaction import PublishLock

    cfg, root, store, history = _daemon_parts(a, need_state=False)
    with PublishLock(root):
        proposal = history.proposal()
        if proposal is None:
            raise ConfigError("no proposal waits for approval (autotune history shows the history)")
        if a.reject:
            history.settle(proposal, "rejected", reason="rejected by hand")
            store.clear_approval()
            print(f"autotune: entry {proposal.number} rejected; production unchanged")
            return EXIT_OK
        store.approve(proposal.number)
    n = proposal.number
    if a.no_wait:
        print(
            f"autotune: entry {n} approved; the daemon starts publishing it within one scrape interval "
            f"({cfg.scrape_interval_s:g} s; autotune status shows how it goes)"
        )
        return EXIT_OK
    print(f"autotune: entry {n} approved; waiting for the daemon to publish it", file=sys.stderr, flush=True)
    wait = float(a.timeout or APPROVAL_WAIT_S)
    deadline = time.monotonic() + wait
    while True:
        e = history.get(n)
        if e is None or e.outcome not in ("proposed", "pending"):
            break
        if time.monotonic() >= deadline:
            taken = store.approval() is None
            print(
                f"autotune: entry {n} is still {e.outcome} after {wait:g} s; "
                + (
                    "the daemon took the approval and goes on publishing (autotune status shows how it goes)"
                    if taken
                    else f"no daemon has taken the approval yet: is the daemon with {a.config} running? The approval "
                    "stays recorded until it does"
                ),
                file=sys.stderr,
            )
            return EXIT_SLO_MISS
        time.sleep(POLL_S)
    if e is None:
        raise ConfigError(f"history entry {n} is gone (autotune history shows the history)")
    print(f"autotune: entry {e.number}: {e.outcome}" + (f" ({e.reason})" if e.reason else ""))
    return EXIT_OK if e.outcome == "published" else EXIT_SLO_MISS


def cmd_rollback(a: argparse.Namespace) -> int:
    from autotune.daemon.production import build_target
    from autotune.daemon.state import Phase
    from autotune.publish.transaction import PublishLock, rollback, rollback_choice

    if a.to is not None and a.to < 1:
        raise ConfigError(
            f"--to names a history entry by its number (1 or more), got {a.to}; autotune history lists them"
        )
    cfg, root, store, history = _daemon_parts(a, need_state=False)
    target = build_target(cfg)
    shares_gpus = getattr(target, "idle_gpus", lambda: None)() is not None
    if shares_gpus and store.path.is_file() and store.load().phase is Phase.TUNING:
        # blue/green whose idle GPUs a tuning holds: the daemon pauses it, rolls back, and resumes it
        good = rollback_choice(history, a.to)
        return _rollback_by_daemon(a, store, history, good.number)
    with PublishLock(root):
        good = rollback_choice(history, a.to)
        entry = rollback(target, history, a.to)
    if entry is None:
        print(f"autotune: production already runs entry {good.number}'s config: nothing changed, nothing restarted")
        return EXIT_OK
    print(f"autotune: production is back on entry {entry.source['rollback_to']} (recorded as entry {entry.number})")
    return EXIT_OK


def _rollback_by_daemon(a: argparse.Namespace, store, history, to: int) -> int:
    before = history.entries()[-1].number if history.entries() else 0
    store.request_rollback(to)
    print(
        f"autotune: a tuning holds the idle GPUs; the daemon pauses it and rolls back to entry {to}",
        file=sys.stderr,
        flush=True,
    )
    deadline = time.monotonic() + float(getattr(a, "timeout", None) or APPROVAL_WAIT_S)
    while store.rollback_request() is not None:  # the daemon removes it once the rollback is done
        if time.monotonic() >= deadline:
            print(
                f"autotune: the daemon has not rolled back yet (is the daemon with {a.config} running? the request "
                "stays until it does; autotune status shows how it goes)",
                file=sys.stderr,
            )
            return EXIT_SLO_MISS
        time.sleep(POLL_S)
    after = [e for e in history.entries() if e.number > before]
    if not after:
        print(f"autotune: production already runs entry {to}'s config: nothing changed, nothing restarted")
        return EXIT_OK
    print(f"autotune: production is back on entry {to} (recorded as entry {after[-1].number})")
    return EXIT_OK
