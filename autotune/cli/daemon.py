"""The daemon's commands: ``autotune daemon`` and what an operator runs beside it (status, retune, publish, rollback)."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from autotune.cli import EXIT_OK, EXIT_SLO_MISS
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
    how = ("start it with this config" if cfg.state_dir is not None else
           f"start it with this config, or name the directory it keeps its state in with state_dir in {cfg.source}")
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
    return "the daemon takes it at its next tick"


def cmd_retune(a: argparse.Namespace) -> int:
    from autotune.daemon.production import has_state

    cfg, root, store, _ = _daemon_parts(a, need_state=False)
    store.request_retune(a.reason)
    if not has_state(root):  # a daemon started later with this config reads it there
        print(f"autotune: note: {_no_state(cfg, [root])}; the request waits for it in {root}", file=sys.stderr)
    print(f"autotune: retune requested ({a.reason}); pending: {_pending_why(cfg, store.load())} "
          "(a request skips the cooldown; autotune status shows it)")
    return EXIT_OK


def cmd_status(a: argparse.Namespace) -> int:
    from autotune.console import print_history

    cfg, root, store, history = _daemon_parts(a)
    st = store.load()
    print(f"phase: {st.phase.value} since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(st.since))}")
    print(f"note: {st.note}")
    print(f"state: {root}")
    request = store.retune_request()
    if request is not None:
        print(f"retune: requested ({request}), pending: {_pending_why(cfg, st)}")
    if st.scrape_error:
        when = time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(st.scrape_error_at))
        print(f"production scrape: {'failing' if st.scrape_failing else 'ok'}; last error at {when}: {st.scrape_error}")
    print_history(history.entries())
    return EXIT_OK


def cmd_history(a: argparse.Namespace) -> int:
    from autotune.console import print_history

    _, _, _, history = _daemon_parts(a)
    print_history(history.entries())
    return EXIT_OK


def cmd_publish(a: argparse.Namespace) -> int:
    from autotune.daemon.production import build_target, production_canary
    from autotune.daemon.fingerprint import Fingerprint
    from autotune.publish.transaction import PublishLock, publish
    from autotune.study.definition import load_study

    cfg, root, store, history = _daemon_parts(a, need_state=False)
    with PublishLock(root):
        proposal = history.proposal()
        if proposal is None:
            raise ConfigError("no proposal waits for approval (autotune history shows the history)")
        if a.reject:
            history.settle(proposal, "rejected", reason="rejected by hand")
            print(f"autotune: entry {proposal.number} rejected; production unchanged")
            return EXIT_OK
        # the canary imitates production's traffic as the daemon last fingerprinted it
        fp = store.load().tuned_fingerprint
        target = build_target(cfg)
        canary = production_canary(cfg, target, Fingerprint.from_json(fp) if fp else None,
                                   load_study(cfg.staging_study).workload.tokenizer)
        result = publish(target, proposal.values, history, canary, entry=proposal)
    print(f"autotune: entry {result.entry.number}: {result.outcome}" +
          (f" ({result.entry.reason})" if result.entry.reason else ""))
    return EXIT_OK if result.ok else EXIT_SLO_MISS


def cmd_rollback(a: argparse.Namespace) -> int:
    from autotune.daemon.production import build_target
    from autotune.publish.transaction import PublishLock, rollback, rollback_choice

    if a.to is not None and a.to < 1:
        raise ConfigError(f"--to names a history entry by its number (1 or more), got {a.to}; "
                          "autotune history lists them")
    cfg, root, _, history = _daemon_parts(a, need_state=False)
    with PublishLock(root):
        good = rollback_choice(history, a.to)
        entry = rollback(build_target(cfg), history, a.to)
    if entry is None:
        print(f"autotune: production already runs entry {good.number}'s config: nothing changed, nothing restarted")
        return EXIT_OK
    print(f"autotune: production is back on entry {entry.source['rollback_to']} (recorded as entry {entry.number})")
    return EXIT_OK
