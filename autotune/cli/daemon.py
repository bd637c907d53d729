"""The daemon's commands: ``autotune daemon`` and what an operator runs beside it (status, retune, publish, rollback)."""

from __future__ import annotations

import argparse
import signal
import sys
import time

from autotune.cli import EXIT_OK, EXIT_SLO_MISS
from autotune.errors import ConfigError

__all__ = ["cmd_daemon", "cmd_retune", "cmd_status", "cmd_publish", "cmd_rollback"]


def cmd_daemon(a: argparse.Namespace) -> int:
    import threading

    from autotune.daemon.config import load_daemon_config
    from autotune.daemon.loop import Daemon

    daemon = Daemon(load_daemon_config(a.config, serving=True))  # its metrics port must be free now
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:  # only notes it: the loop stops after its tick
        received.append(signum)
        stop.set()

    # SIGHUP has no reload meaning yet; its default would end the daemon silently: it stops it, saying so
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    rc = daemon.run(stop)
    if received:
        hup = " (it does not reload its config yet: start it again)" if received[0] == signal.SIGHUP else ""
        print(f"autotune: daemon stopped by {signal.Signals(received[0]).name}{hup}", file=sys.stderr)
    return rc


def _daemon_parts(a: argparse.Namespace):
    from autotune.daemon.config import load_daemon_config
    from autotune.daemon.production import daemon_root
    from autotune.daemon.state import StateStore
    from autotune.publish.history import History

    cfg = load_daemon_config(a.config)
    root = daemon_root(cfg)
    return cfg, root, StateStore(root), History(root / "history")


def cmd_retune(a: argparse.Namespace) -> int:
    _, _, store, _ = _daemon_parts(a)
    store.request_retune(a.reason)
    print(f"autotune: retune requested ({a.reason}); the daemon starts it at its next tick "
          "(tuning windows still apply; a request skips the cooldown)")
    return EXIT_OK


def cmd_status(a: argparse.Namespace) -> int:
    from autotune.console import print_history

    _, _, store, history = _daemon_parts(a)
    st = store.load()
    print(f"phase: {st.phase.value} since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(st.since))}")
    print(f"note: {st.note}")
    if st.scrape_error:
        when = time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(st.scrape_error_at))
        print(f"production scrape: {'failing' if st.scrape_failing else 'ok'}; last error at {when}: {st.scrape_error}")
    print_history(history.entries())
    return EXIT_OK


def cmd_publish(a: argparse.Namespace) -> int:
    from autotune.daemon.production import build_target, production_canary
    from autotune.daemon.fingerprint import Fingerprint
    from autotune.publish.transaction import PublishLock, publish
    from autotune.study.definition import load_study

    cfg, root, store, history = _daemon_parts(a)
    with PublishLock(root):
        proposal = history.proposal()
        if proposal is None:
            raise ConfigError("no proposal waits for approval (autotune status shows the history)")
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
    from autotune.publish.transaction import PublishLock, rollback

    if a.to is not None and a.to < 1:
        raise ConfigError(f"--to names a history entry by its number (1 or more), got {a.to}; autotune status lists them")
    cfg, root, _, history = _daemon_parts(a)
    with PublishLock(root):
        entry = rollback(build_target(cfg), history, a.to)
    print(f"autotune: production is back on entry {entry.source['rollback_to']} (recorded as entry {entry.number})")
    return EXIT_OK
