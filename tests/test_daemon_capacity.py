"""``autotune_production_capacity_requests_per_second`` survives a daemon restart (issue 15, item 10).

It comes back from the state directory alone: the last tuning's measurement of production's config
while production still runs it, the winner's measurement once the daemon published it, and the
tuning's measurement again after ``autotune rollback --to`` the config it measured. Production does
not answer here (tests/test_daemon_decisions.py's file); the tuning's result is made up, as there.
"""

import time

from prometheus_client import generate_latest

from autotune.daemon.config import load_daemon_config
from autotune.daemon.exporter import DaemonMetrics
from autotune.daemon.loop import Daemon
from autotune.daemon.state import DaemonState, Phase, StateStore
from tests.test_daemon_decisions import daemon_file, entry, tie_with_production_one_run_each  # noqa: F401

GAUGE = "autotune_production_capacity_requests_per_second"


def _capacity(metrics: DaemonMetrics) -> str | None:
    """The gauge's sample line; None where it has none (unknown)."""
    return next((line for line in generate_latest(metrics.registry).decode().splitlines()
                 if line.startswith(f"{GAUGE} ")), None)


def _restarted(path, read_result) -> tuple[Daemon, DaemonMetrics]:
    metrics = DaemonMetrics()
    d = Daemon(load_daemon_config(path), metrics=metrics, read_result=read_result)
    d._resume()  # what `run` does first
    return d, metrics


def test_production_capacity_comes_back_after_a_restart(daemon_file, state_dir):  # noqa: F811
    path = daemon_file()
    root = state_dir / "daemon" / "prod"
    t0 = time.time() - 3600
    entry(root, 1, "adopted", {"max_num_seqs": 2}, time=t0)
    # the last tuning (production measured 8.0 req/s on staging, one run) kept production's config
    loads = []
    def read(storage, name):
        loads.append(name)
        return tie_with_production_one_run_each()

    StateStore(root).save(DaemonState(phase=Phase.WATCHING, since=t0 + 600, study_name="prod-tune-001", tunings=1,
                                      tuning_started=t0 + 60, last_tuning_end=t0 + 600))

    d, metrics = _restarted(path, read)
    assert _capacity(metrics) == f"{GAUGE} 8.0", "the gauge is 0 after a restart"
    d.tick()
    d.tick()
    assert _capacity(metrics) == f"{GAUGE} 8.0" and loads == ["prod-tune-001"]  # a finished study is read once

    # the daemon published a later tuning's winner: production's capacity is the winner's, after a restart too
    entry(root, 2, "published", {"max_num_seqs": 24}, time=t0 + 700,
          source={"study": "prod-tune-002", "trial": 3, "capacity_rps": 11.1})
    d.tick()
    assert _capacity(metrics) == f"{GAUGE} 11.1"
    d, metrics = _restarted(path, read)
    assert _capacity(metrics) == f"{GAUGE} 11.1"

    # `autotune rollback --to 1`: production runs the config the last tuning measured again
    entry(root, 3, "published", {"max_num_seqs": 2}, time=t0 + 800, source={"rollback_to": 1, "by": "hand"})
    d.tick()
    assert _capacity(metrics) == f"{GAUGE} 8.0"


def test_a_rollback_during_a_tuning_is_not_credited_with_what_the_tuning_measured(daemon_file,  # noqa: F811
                                                                                  state_dir):
    """The tuning measured production's config when it started (24 sequences, 8.0 req/s); a rollback by hand
    to an older entry (2 sequences) meanwhile: that 8.0 is not the capacity of what production runs now."""
    path = daemon_file()
    root = state_dir / "daemon" / "prod"
    t0 = time.time() - 3600
    entry(root, 1, "adopted", {"max_num_seqs": 2}, time=t0)
    entry(root, 2, "published", {"max_num_seqs": 24}, time=t0 + 10,
          source={"study": "prod-tune-000", "trial": 3, "capacity_rps": 11.1})
    # the tuning started on entry 2's config, then `autotune rollback --to 1`, then the tuning ended
    entry(root, 3, "published", {"max_num_seqs": 2}, time=t0 + 300, source={"rollback_to": 1, "by": "hand"})
    StateStore(root).save(DaemonState(phase=Phase.WATCHING, since=t0 + 600, study_name="prod-tune-001", tunings=1,
                                      tuning_started=t0 + 60, last_tuning_end=t0 + 600,
                                      production_values={"max_num_seqs": 24}))
    d, metrics = _restarted(path, lambda storage, name: tie_with_production_one_run_each())
    d.tick()
    # nothing measured entry 1's config: the gauge has no sample rather than the 8.0 of the 24-sequence config
    assert _capacity(metrics) is None, _capacity(metrics)
    # had production kept entry 2's config, the tuning's 8.0 would be its capacity
    entry(root, 4, "published", {"max_num_seqs": 24}, time=t0 + 700, source={"rollback_to": 2, "by": "hand"})
    d.tick()
    assert _capacity(metrics) == f"{GAUGE} 8.0"
