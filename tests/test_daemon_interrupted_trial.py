"""A trial a stop signal cut short is interrupted, not crashed: its baseline runs again on resume (issue 15, item 2).

When the daemon stops (systemd signals its whole cgroup), the stop may reach the tuning's staging
engine before the study: the measurement then sees an engine that died, a crashed baseline is
PRUNED, and a resumed study counts a PRUNED baseline as done, so production's own config would
never be measured again. The measurement is a stand-in (tests/measurers.py) that is exactly that (a crashed outcome with
the stop already received): what is under test is what the study records, not how the engine dies
(tests/test_signals.py stops real vllm-sim engines).
"""

import signal
import sys

import optuna
import pytest
from optuna.trial import TrialState

from autotune.engine import launcher
from autotune.engine.failures import Failure, FailureClass
from autotune.errors import Interrupted
from autotune.measure.session import Outcome
from autotune.study.definition import load_study
from autotune.study.runner import StudyRun
from autotune.study.storage import open_study
from autotune.workload.source import LoadSteps
from tests.conftest import free_port
from tests.measurers import SetOutcomes
from tests.test_daemon import STAGING

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture
def definition(tmp_path, tiny_model, state_dir):
    text = STAGING.format(root=tmp_path, python=sys.executable, port=free_port(), model=tiny_model)
    text = text.replace('builtin = ["vllm-defaults"]', 'builtin = []\nproduction = { max_num_seqs = 8 }')
    path = tmp_path / "tune.toml"
    path.write_text(text)
    return load_study(path)


@pytest.fixture
def stop_signal():
    """The launcher's stop flag as its handler leaves it once the Interrupted it raised went astray; reset after."""
    saved = (launcher._Signals.received, launcher._Signals.raised)
    yield
    launcher._Signals.received, launcher._Signals.raised = saved


def test_a_baseline_the_stop_cut_short_fails_and_runs_again_on_resume(definition, stop_signal):
    def engine_killed_by_the_stop(config, n):
        launcher._Signals.received, launcher._Signals.raised = signal.SIGTERM, True
        return Outcome(url="http://127.0.0.1:1", failure=Failure(
            FailureClass.CRASHED, "died after becoming ready: exit code -15 (SIGTERM)", exit_code=-15))

    measurer = SetOutcomes.of(definition, engine_killed_by_the_stop)
    run = StudyRun(definition, measurer, LoadSteps(definition.workload))
    study = open_study(definition)
    with pytest.raises(Interrupted):
        run.optimize(study)
    trials = study.get_trials(deepcopy=False)
    assert [(t.user_attrs.get("baseline"), t.state) for t in trials] == [("production", TrialState.FAIL)]
    assert run.interrupted_trial(study) == 0  # what `autotune study` says: "during trial 0 (recorded as failed)"

    # the resumed study (the daemon restarted) measures production's config again, first
    launcher._Signals.received, launcher._Signals.raised = None, False
    StudyRun.on_engine(definition, definition.command.flag_table(), LoadSteps(definition.workload)).prepare(study)
    waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    assert [t.user_attrs.get("baseline") for t in waiting] == ["production"]
