"""`autotune status`, the command itself, as an operator runs it beside the daemon (issue 15): the proposal that
waits for approval with its diff against production, its gain and the spread it beat, and the last decision's
reason, still there once later ticks replaced the note.

The state is left by the daemon's own code (``TuningPhase.finish`` on a tuning's result, then ``tick``), not
written by hand; production does not answer (tests/test_daemon_decisions.py's ``daemon_file``).
"""

from dataclasses import replace

from autotune.daemon.config import load_daemon_config
from autotune.daemon.loop import Daemon
from autotune.daemon.state import DaemonState, Phase
from tests.test_daemon_decisions import _beats_production, cli, daemon_file, entry  # noqa: F401  (daemon_file: the fixture)
from tests.test_daemon_decisions import tie_with_production_one_run_each


def test_status_shows_the_proposal_its_diff_its_gain_and_its_probability_and_the_last_decision(capsys, daemon_file, state_dir,
                                                                                      monkeypatch):
    p = daemon_file()
    root = state_dir / "daemon" / "prod"
    entry(root, 1, "adopted", {"max_num_seqs": 2})  # what production runs
    cfg = load_daemon_config(p)
    d = Daemon(replace(cfg, approval=True))
    d.state = d.store.save(DaemonState(phase=Phase.TUNING, study_name="prod-tune-001", trigger="requested: test"))
    d.read_result = lambda storage, name: _beats_production()
    d.tuning.finish(0)
    d.tick()
    assert d.state.phase is Phase.AWAITING_APPROVAL, d.state.note
    capsys.readouterr()  # the journal's lines
    code, out, err = cli(capsys, "status", "--config", p)
    assert code == 0, err
    lines = out.splitlines()
    why = "trial 2 11.00 req/s vs production 5.00: +6.00 req/s; P = 1.00 that it beats production by more than 2% (a gain worth a restart), 0.9 required"
    assert lines[0].startswith("phase: awaiting_approval since "), out
    assert "proposal: entry 2, trial 2 of prod-tune-001 (tuned because: requested: test)" in lines, out
    assert f"  gain: {why}" in lines, out
    assert "  values: max_num_seqs=48" in lines, out
    assert "  against production: max_num_seqs 2 -> 48" in lines, out
    decision = next(x for x in lines if x.startswith("last decision: "))
    assert decision.endswith(f": entry 2 (trial 2 of prod-tune-001) waits for `autotune publish --approve`: {why}")

    # the next tuning keeps production's config; ticks later the note says "watching", status still says why
    code, _, err = cli(capsys, "publish", "--config", p, "--reject")
    assert code == 0, err
    d = Daemon(cfg)
    d.tick()
    assert d.state.phase is Phase.WATCHING
    d.state = d.store.save(d.state.to(Phase.TUNING, study_name="prod-tune-002", trigger="requested: again"))
    d.read_result = lambda storage, name: tie_with_production_one_run_each()
    d.tuning.finish(0)
    d.tick()
    d.tick()
    assert "production's config stays" not in d.state.note, d.state.note  # later ticks replaced the note
    capsys.readouterr()
    code, out, err = cli(capsys, "status", "--config", p)
    assert code == 0, err
    lines = out.splitlines()
    assert not any(x.startswith("proposal:") for x in lines), out  # rejected: none waits
    decision = next(x for x in lines if x.startswith("last decision: "))
    assert (": tuning prod-tune-002: production's config stays (trial 2 8.00 req/s vs production 8.00: +0.00 req/s, "
            "not surely a gain (P = ") in decision, decision
    assert "that it beats production by more than 2% (a gain worth a restart), 0.9 required))" in decision, decision
