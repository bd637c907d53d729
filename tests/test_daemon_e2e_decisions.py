"""More of the daemon's wrong decisions of issue 15, end to end, with tests/test_daemon_e2e.py's rig: its own loop
ticking in this process, vllm-sim as production (behind the systemctl stand-in) and as staging, users' real
traffic, and the commands an operator types. Checked not to happen any more:

- item 6: ``autotune publish --approve`` published in the CLI's process, and the daemon never showed publishing
  or verifying; the CLI (here a real process, waiting) must leave the publish to the daemon and print its outcome;
- item 9: a tuning's ``production`` baseline recorded the space's defaults, not the config production runs;
- item 10: a rollback by hand did not count in ``autotune_rollbacks_total``; after a daemon restart the
  last-publish metrics read 0 and ``autotune_publishes_total`` was gone;
- item 11: ``rollback --to 99`` ended in a traceback; a sampler's 0.8600000000000001 reached production's YAML.

Every process started here (production's vllm-sim, a tuning's child and its staging engine, the CLI process) is
stopped in teardown: the ``prod`` fixture's, or the test's own ``finally``.
"""

import os
import subprocess
import sys
import time

import optuna
import pytest
import yaml
from prometheus_client import generate_latest

from autotune.study.lines import trial_line
from autotune.daemon.loop import Daemon
from autotune.daemon.state import DaemonState, Phase
from autotune.study.records import Attr, StudyResult
from tests.conftest import ROOT
from tests.test_daemon_e2e import TICK_S, Users, cli, ticks, watched_a_full_window
from tests.test_daemon_e2e import prod  # noqa: F401  (the fixture)


def _propose(d: Daemon, **changes) -> int:
    """A proposal waits for approval, as a tuning leaves it (its numbers do not matter here): production's whole
    config with ``changes``. Its entry's number."""
    adopted = d.history.entries()[0].values
    proposal = d.history.add("proposed", {**adopted, **changes},
                             source={"study": "prod-tune-001", "trial": 3, "capacity_rps": 9.0})
    d.state = d.store.save(DaemonState(phase=Phase.AWAITING_APPROVAL, since=time.time(), tunings=1,
                                       study_name="prod-tune-001", note=f"entry {proposal.number} waits"))
    return proposal.number


def _publish_on_the_loop(d: Daemon, capsys, path, number: int) -> list[tuple[str, str]]:
    """`autotune publish --approve --no-wait`, then the daemon's ticks until it watches again (users' traffic must
    flow: the canary is shaped like it)."""
    ticks(d, 30, until=watched_a_full_window)
    assert watched_a_full_window(d), d.state.note
    code, out, err = cli(capsys, "publish", "--config", path, "--approve", "--no-wait")
    assert code == 0, err
    seen = ticks(d, 90, until=lambda d: d.state.phase is Phase.WATCHING)
    assert d.state.phase is Phase.WATCHING, seen
    assert d.history.get(number).outcome == "published", (seen, d.history.get(number))
    return seen


def _sample(d: Daemon, name: str, **labels) -> float | None:
    return d.metrics.registry.get_sample_value(name, labels)


# -- item 6: `publish --approve` waits while the daemon publishes on its own loop ------------------------------------

def test_publish_approve_waits_while_the_daemon_publishes_and_verifies_on_its_loop(prod, capsys):
    path = prod.write(approval=True)
    d = prod.daemon()
    n = _propose(d, max_num_seqs=32)
    with Users(prod.port) as users:
        ticks(d, 30, until=watched_a_full_window)
        assert watched_a_full_window(d), d.state.note
        assert d.state.phase is Phase.AWAITING_APPROVAL, d.state.note
        restarts = prod.restarts()
        # the operator's command, in its own process (the env carries AUTOTUNE_STATE_DIR), waiting for the outcome
        proc = subprocess.Popen([sys.executable, "-m", "autotune", "publish", "--config", str(path), "--approve",
                                 "--timeout", "120"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            seen: list[tuple[str, str, bool]] = []  # (phase, note, whether the CLI still waits)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                d.tick()
                now = (d.state.phase.value, d.state.note, proc.poll() is None)
                if not seen or seen[-1][:2] != now[:2]:
                    seen.append(now)
                if d.state.phase is Phase.WATCHING and proc.poll() is not None:
                    break
                time.sleep(TICK_S)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    phases = [p for p, _, _ in seen]
    assert phases[:4] == ["awaiting_approval", "publishing", "verifying", "watching"], seen
    # the CLI waited through the daemon's publish and canary, and did not publish itself: one restart, the daemon's
    assert all(waiting for p, _, waiting in seen if p in ("publishing", "verifying")), seen
    assert proc.returncode == 0, (out, err)
    assert f"autotune: entry {n} approved; waiting for the daemon to publish it" in err, err
    assert out.strip().splitlines()[-1].startswith(f"autotune: entry {n}: published"), out
    assert d.history.get(n).outcome == "published"
    assert d.history.get(n).source["approved"] == "by hand"  # the history says who decided
    assert prod.restarts() == restarts + 1 and "max-num-seqs: 32" in prod.config.read_text()
    assert d.store.approval() is None
    print(f"users: {users.failed} of {users.sent} requests failed")


# -- item 9: the `production` baseline records production's values ------------------------------------------------

def test_the_production_baseline_of_a_tuning_records_what_production_runs(prod, capsys):
    prod.write()
    d = prod.daemon()
    assert "max-num-seqs: 2" in prod.config.read_text()
    with Users(prod.port):
        ticks(d, 30, until=watched_a_full_window)
    assert d.fingerprint is not None, d.state.note
    d.tuning.start("requested: e2e", d.fingerprint)  # as the daemon does when a trigger fires
    assert d.state.phase is Phase.TUNING and d.state.production_values["max_num_seqs"] == 2, d.state
    name, storage = d.state.study_name, d.study.storage

    def production_trial():
        try:
            study = optuna.load_study(study_name=name, storage=storage)
        except KeyError:  # not created yet
            return None
        return next((t for t in study.get_trials(deepcopy=False) if t.user_attrs.get(Attr.BASELINE) == "production"
                     and t.state.is_finished()), None)

    try:
        ticks(d, 240, until=lambda d: production_trial() is not None or d.state.phase is not Phase.TUNING)
        t = production_trial()
        log = d.root / "tunings" / f"{name}.log"
        assert t is not None, (d.state.note, log.read_text()[-3000:] if log.exists() else "no log")

        def logged() -> list[str]:  # the tuning's journal: "HH:MM:SS trial N (baseline production) ... -> ..."
            return [x for x in log.read_text().splitlines() if f" trial {t.number} (baseline production) " in x]

        deadline = time.monotonic() + 20  # the child prints its line just after the storage has the trial
        while not logged() and time.monotonic() < deadline:
            time.sleep(TICK_S)
        lines = logged()
    finally:
        d.tuning.stop()
    print(f"production trial {t.number}: params {t.params}, argv {t.user_attrs.get(Attr.ARGV)}")
    # Optuna's params and the user attrs: production's 2, not the space's default (64)
    assert t.params.get("max_num_seqs") == 2, (t.params, t.user_attrs)
    engine_args = t.user_attrs.get(Attr.ENGINE_ARGS)
    if engine_args is not None:
        assert engine_args["values"]["max_num_seqs"] == 2, engine_args
    assert (t.user_attrs.get(Attr.BASELINE_ARGS) or {}).get("max_num_seqs", 2) == 2, t.user_attrs
    argv = t.user_attrs.get(Attr.ARGV)
    if argv is not None:
        argv = argv.split() if isinstance(argv, str) else list(argv)
        pairs = list(zip(argv, argv[1:]))
        assert ("--max-num-seqs", "2") in pairs, argv
        assert not [v for k, v in pairs if k == "--max-num-seqs" and v != "2"], argv
    # the trial line, as the tuning's log prints it and as the console writes it from the record
    record = next(r for r in StudyResult.load(storage, name).records if r.number == t.number)
    line = trial_line(record, None)
    assert "max_num_seqs=2 " in line and "max_num_seqs=64" not in line, line
    print(f"its line: {line}\nlogged: {lines}")
    assert len(lines) == 1 and "max_num_seqs=2 " in lines[0] and "max_num_seqs=64" not in lines[0], lines


# -- item 10: metrics count a rollback by hand and survive a daemon restart ----------------------------------------

def test_metrics_count_a_rollback_by_hand_and_come_back_after_a_restart(prod, capsys):
    path = prod.write(approval=True)
    d = prod.daemon()
    n = _propose(d, max_num_seqs=32)
    with Users(prod.port):
        _publish_on_the_loop(d, capsys, path, n)
    assert _sample(d, "autotune_publishes_total", outcome="published") == 1
    assert _sample(d, "autotune_rollbacks_total") == 0
    assert _sample(d, "autotune_last_publish_success") == 1
    published_at = _sample(d, "autotune_last_publish_timestamp_seconds")
    assert published_at and published_at >= d.history.get(n).time
    assert _sample(d, "autotune_production_capacity_requests_per_second") == 9.0  # what the proposal's tuning measured

    # a restart: a new Daemon on the same state directory reads them back from the history
    d2 = prod.daemon()
    d2.tick()
    assert _sample(d2, "autotune_publishes_total", outcome="published") == 1, generate_latest(d2.metrics.registry)
    assert _sample(d2, "autotune_last_publish_success") == 1
    assert (_sample(d2, "autotune_last_publish_timestamp_seconds") or 0) >= d.history.get(n).time
    assert _sample(d2, "autotune_production_capacity_requests_per_second") == 9.0
    assert _sample(d2, "autotune_rollbacks_total") == 0

    # a rollback by hand, from the CLI (another process, as far as the daemon knows): production goes back to 1
    restarts = prod.restarts()
    code, out, err = cli(capsys, "rollback", "--config", path)
    assert code == 0, err
    assert out.strip().startswith("autotune: production is back on entry 1"), out
    assert prod.restarts() == restarts + 1 and "max-num-seqs: 2" in prod.config.read_text()
    back = d2.history.entries()[-1]
    assert back.source.get("rollback_to") == 1
    ticks(d2, 2 * TICK_S)
    assert _sample(d2, "autotune_rollbacks_total") == 1, generate_latest(d2.metrics.registry).decode()
    assert _sample(d2, "autotune_publishes_total", outcome="published") == 1  # a rollback is not a publish
    assert _sample(d2, "autotune_last_publish_timestamp_seconds") == pytest.approx(back.time)

    # and another restart keeps all of it
    d3 = prod.daemon()
    d3.tick()
    text = generate_latest(d3.metrics.registry).decode()
    assert _sample(d3, "autotune_rollbacks_total") == 1, text
    assert _sample(d3, "autotune_publishes_total", outcome="published") == 1, text
    assert _sample(d3, "autotune_last_publish_timestamp_seconds") == pytest.approx(back.time), text
    assert _sample(d3, "autotune_last_publish_success") == 1, text
    info = next(x for x in text.splitlines() if x.startswith("autotune_production_config_info{"))
    assert f'entry="{back.number}"' in info and 'max_num_seqs="2"' in info, info  # what production runs


# -- item 11: `rollback --to 99` in one line; floats as a person writes them ------------------------------------------

def test_rollback_to_a_missing_entry_is_one_line_and_floats_reach_the_yaml_as_written(prod, capsys):
    path = prod.write(approval=True)
    d = prod.daemon()
    n = _propose(d, max_num_seqs=16, gpu_memory_utilization=0.8600000000000001)
    with Users(prod.port):
        _publish_on_the_loop(d, capsys, path, n)
    text = prod.config.read_text()
    assert "0.8600000000000001" not in text, text
    assert yaml.safe_load(text)["gpu-memory-utilization"] == 0.86, text
    assert "gpu-memory-utilization: 0.86\n" in text, text
    assert "max-num-seqs: 16" in text, text
    restarts = prod.restarts()
    code, out, err = cli(capsys, "rollback", "--config", path, "--to", 99)
    assert code == 2, (out, err)
    assert out == "", out
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("autotune: there is no history entry 99: the history has entries 1 to 2"), err
    assert "1, 2 can be restored" in err, err
    assert prod.restarts() == restarts
    # the command the error points at exists
    code, out, err = cli(capsys, "history", "--config", path)
    assert code == 0 and "published" in out and "adopted" in out, (out, err)
