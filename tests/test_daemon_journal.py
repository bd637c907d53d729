"""The journal (the daemon's stdout: `journalctl -u autotune` under systemd) says what a tuning measured and why
its winner goes to production (issue 15): one line per finished trial, once each (a restarted daemon does not
repeat them), and the gain and the spread in the "awaiting approval" and "publishing" lines.

The daemon's own loop (``Daemon.tick``) runs on a tuning whose child is a stand-in and whose study grows as a
real one does; production does not answer (tests/test_daemon_decisions.py's ``daemon_file``). The trial lines
of a real tuning are checked end to end in tests/test_daemon_e2e_tunings.py.
"""

from dataclasses import replace

from optuna.trial import TrialState

from autotune.daemon.config import load_daemon_config
from autotune.daemon.loop import Daemon
from autotune.daemon.state import DaemonState, Phase
from autotune.study.records import StudyResult
from tests.test_daemon_decisions import _beats_production, daemon_file  # noqa: F401  (daemon_file: the fixture)

WHY = "trial 2 11.00 req/s vs production 5.00: +6.00 req/s; P = 1.00 that it beats production by more than 2% (a gain worth a restart), 0.9 required"


class _Child:
    """The tuning's child process, as the loop sees it: running until ``rc`` is set."""

    def __init__(self) -> None:
        self.rc: int | None = None

    def poll(self) -> int | None:
        return self.rc

    def stop(self, grace: float = 60.0) -> None:
        pass


def test_the_journal_has_a_line_per_finished_trial_and_the_gain_and_probability_of_the_winner(capsys, daemon_file,
                                                                                          monkeypatch):
    cfg = replace(load_daemon_config(daemon_file()), approval=True)
    d = Daemon(cfg)
    d.state = d.store.save(DaemonState(phase=Phase.TUNING, study_name="prod-tune-001", trigger="requested: test"))
    child = d.tuning.child = _Child()
    full = _beats_production()
    study = {"finished": 0}  # how many of its trials have finished; the next one runs

    def load(storage, name):
        records = [r if r.number < study["finished"] else replace(r, state=TrialState.RUNNING)
                   for r in full.records[:study["finished"] + 1]]
        return StudyResult(records, False, full.remeasurement if study["finished"] == 3 else None, 2)

    d.read_result = load
    capsys.readouterr()

    def journal() -> list[str]:
        d.tick()
        return capsys.readouterr().out.splitlines()

    assert journal() == []  # trial 0 runs
    study["finished"] = 1
    first = journal()
    assert len(first) == 1, first
    assert first[0].startswith("tuning: prod-tune-001: trial 0 (baseline production) max_num_seqs=32 -> 5.00 req/s "
                               "within the SLOs"), first
    assert journal() == []  # told once
    study["finished"] = 2
    second = journal()
    assert len(second) == 1 and second[0].startswith("tuning: prod-tune-001: trial 1 (baseline vllm-defaults) "
                                                     "max_num_seqs=64 -> 6.00 req/s"), second

    d = Daemon(cfg, read_result=load)  # the daemon restarts mid-tuning: what it told stays told
    d.tuning.child = child
    assert journal() == []

    study["finished"] = 3
    child.rc = 0  # the study ended with its re-measurement
    last = journal()
    assert len(last) == 2, last
    assert last[0].startswith("tuning: prod-tune-001: trial 2 (") and "max_num_seqs=48 -> 11.00 req/s" in last[0], last
    assert last[1] == f"awaiting_approval: entry 1 (trial 2 of prod-tune-001) waits for `autotune publish --approve`: {WHY}"

    # without approval the winner is published at once, and the journal says why in the same words
    d.cfg = replace(cfg, approval=False)
    d.state = d.store.save(DaemonState(phase=Phase.TUNING, study_name="prod-tune-001", trials_told=(0, 1, 2)))
    monkeypatch.setattr(d.publishing, "_publish", lambda values, source, entry=None: None)
    d.tuning.finish(0)
    assert capsys.readouterr().out.splitlines() == [f"publishing: publishing trial 2 of prod-tune-001: {WHY}"]


def test_tunings_total_is_rebuilt_from_the_state_after_a_restart(daemon_file):
    cfg = load_daemon_config(daemon_file())
    d = Daemon(cfg)
    # two drift tunings this state counted by trigger, and one from before it did
    d.state = d.store.save(DaemonState(tunings=3, tunings_by_trigger={"drift": 2}))
    for daemon in (d, Daemon(cfg)):  # the running daemon, then a restarted one with fresh metrics
        daemon.tick()
        daemon.tick()  # counters only go up: a second tick adds nothing
        sample = lambda trigger: daemon.metrics.registry.get_sample_value(  # noqa: E731
            "autotune_tunings_total", {"trigger": trigger})
        assert (sample("drift"), sample("unrecorded")) == (2.0, 1.0)
