"""Trials side by side on a study's GPUs (study/slots.py): where each trial runs, that no two share a GPU, that a
config is measured once however many threads sample it, and that a stop signal unwinds every trial and engine.

The slots are declared GPU ids: NVML cannot run here, and vllm-sim ignores CUDA_VISIBLE_DEVICES, so each "GPU" is
an engine process on its own port. The study tests with vllm-sim start real engines over HTTP.
"""

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time

import optuna
import pytest
from optuna.trial import TrialState

from autotune.errors import ConfigError, Interrupted
from autotune.measure.session import Outcome
from autotune.study.definition import derive_study, load_study
from autotune.study.runner import StudyRun
from autotune.study.slots import Slot, Slots, parse_gpu_ids, study_gpus
from autotune.study.storage import open_study
from autotune.workload.source import LoadSteps
from tests.conftest import ROOT, free_port
from tests.measurers import SetOutcomes
from tests.test_study_space import step
from tests.test_signals import Autotune, assert_nothing_left, cleanup  # noqa: F401 (cleanup: a fixture)
from tests.test_study_sim import STUDY as SIM_STUDY

optuna.logging.set_verbosity(optuna.logging.WARNING)


# -- which GPUs, and how they are handed out -----------------------------------------------------------------


def test_gpu_ids_are_read_as_lists_and_ranges_and_bad_ones_say_how_to_write_them():
    assert parse_gpu_ids("0-3,6") == (0, 1, 2, 3, 6)
    assert parse_gpu_ids(" 5 ") == (5,)
    assert parse_gpu_ids("inherit") == ()
    for bad, said in (("3-1", "runs backwards"), ("gpu0", "write e.g."), ("0,0-1", "names a GPU twice"), ("", "is not a GPU index")):
        with pytest.raises(ValueError, match=said):
            parse_gpu_ids(bad)


def test_a_study_uses_its_own_gpus_else_one_slot_where_the_environment_already_chose(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert study_gpus((2, 3), {}) == (2, 3)
    assert study_gpus((), {}) is None  # "inherit"
    assert study_gpus(None, {"CUDA_VISIBLE_DEVICES": "1"}) is None
    assert study_gpus(None, {}) is None  # NVML sees no GPU on this host
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert study_gpus(None, {}) is None


def test_trials_take_aligned_blocks_that_pack_and_never_share_a_gpu():
    slots = Slots(range(8), port=8100)
    a, b = slots.take(2), slots.take(1)
    assert (a.gpus, a.port) == ((0, 1), 8100) and (b.gpus, b.port) == ((2,), 8102)
    assert slots.take(4).gpus == (4, 5, 6, 7)  # 0-3 is not whole: the aligned block that is
    assert slots.try_take(2) is None and slots.try_take(1).gpus == (3,)
    slots.give(a)
    assert slots.try_take(2).gpus == (0, 1)
    assert Slot((0, 1), 8100).env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert slots.unfit(16) == "it needs 16 GPUs and the study has 8 (0,1,2,3,4,5,6,7)"
    assert slots.concurrency(1) == 8 and slots.concurrency(4) == 2


def test_without_gpus_there_is_one_slot_that_sets_nothing():
    slots = Slots(None, port=8100)
    one = slots.take(4)
    assert one == Slot((), 8100) and one.env == {} and slots.try_take(1) is None and slots.unfit(8) is None
    assert slots.concurrency() == 1


def test_a_wide_trial_is_served_before_narrow_ones_that_asked_after_it():
    slots = Slots(range(2), port=8100)
    first = slots.take(1)
    order: list[str] = []

    def ask(name: str, n: int) -> None:
        got = slots.take(n)
        order.append(name)
        time.sleep(0.1)
        slots.give(got)

    wide = threading.Thread(target=ask, args=("wide", 2))
    wide.start()
    time.sleep(0.3)  # the wide one waits first
    narrow = threading.Thread(target=ask, args=("narrow", 1))
    narrow.start()
    time.sleep(0.3)
    assert order == []  # GPU 1 is free, but the narrow one may not pass the wide one
    slots.give(first)
    wide.join(5), narrow.join(5)
    assert order == ["wide", "narrow"]


def test_a_stop_ends_the_wait_for_a_slot():
    slots = Slots(range(1), port=8100)
    slots.take(1)
    with pytest.raises(Interrupted):
        slots.take(1, check=lambda: (_ for _ in ()).throw(Interrupted(signal.SIGTERM)))
    assert slots._queue == []  # nobody left waiting in line


# -- the study file and the flag -------------------------------------------------------------------------


def _sim_study(tmp_path, tiny_model, *, gpus='"0-1"', trials=4, step_duration="2s", extra=""):
    name = "parallel"
    text = SIM_STUDY.format(name=name, runs=tmp_path, python=sys.executable, port=free_port(), model=tiny_model,
                            kind="capacity", trials=trials)
    text = text.replace('startup_timeout = "60s"', f'startup_timeout = "60s"\ngpus = {gpus}' if gpus else
                        'startup_timeout = "60s"')
    text = text.replace('step_duration = "2s"', f'step_duration = "{step_duration}"') + extra
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


def test_the_study_file_and_the_flag_name_the_gpus_and_refuse_two_answers(tmp_path, tiny_model):
    d = load_study(_sim_study(tmp_path, tiny_model, gpus='"0-1"'))
    assert d.gpu_ids == (0, 1)
    assert d.with_overrides(gpus="4-7").gpu_ids == (4, 5, 6, 7)
    with pytest.raises(ConfigError, match=r"parallel.toml \[engine\].gpus: '0-x' is not a GPU index"):
        load_study(_sim_study(tmp_path, tiny_model, gpus='"0-x"'))
    both = _sim_study(tmp_path, tiny_model, extra='\n[engine.env]\nCUDA_VISIBLE_DEVICES = "1"\n')
    with pytest.raises(ConfigError, match=r"both say which GPUs the engine uses: keep one"):
        load_study(both)
    with pytest.raises(ConfigError, match=r"--gpus and the study's \[engine.env\] CUDA_VISIBLE_DEVICES"):
        load_study(_sim_study(tmp_path, tiny_model, gpus=None, extra='\n[engine.env]\nCUDA_VISIBLE_DEVICES = "1"\n')
                   ).with_overrides(gpus="0-1")


def test_the_daemons_tunings_run_one_at_a_time_unless_the_staging_study_names_its_gpus(tmp_path, tiny_model):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt_tokens": 8, "output_tokens": 4, "arrival_s": 0}\n')

    def derived(template, **kw):
        out = derive_study(template, tmp_path / "tuning.toml", name="t", storage=f"sqlite:///{tmp_path}/t.db",
                           runs_dir=tmp_path, slos=["ttft<1s"], trace=trace, tokenizer=tiny_model, step_duration="2s",
                           baselines={}, **kw)
        return load_study(out)

    assert derived(_sim_study(tmp_path, tiny_model, gpus=None)).gpu_ids == ()  # "inherit": one slot, as before
    assert derived(_sim_study(tmp_path, tiny_model, gpus='"2-3"')).gpu_ids == (2, 3)
    idle = derived(_sim_study(tmp_path, tiny_model, gpus='"2-3"'), engine_env={"CUDA_VISIBLE_DEVICES": "1"})
    assert idle.gpu_ids is None and idle.fixed.env["CUDA_VISIBLE_DEVICES"] == "1"  # blue/green's idle color


# -- the runner, on a measurer that starts nothing -------------------------------------------------------------


class Timed(SetOutcomes):
    """Each measurement takes ``seconds`` and remembers where and when it ran."""

    def __init__(self, d, seconds: float, capacity=lambda values: 2.0):
        super().__init__(d.command, d.command.flag_table(), self._answer)
        self.seconds, self.capacity = seconds, capacity
        self.ran: list[tuple[float, float, Slot, dict]] = []
        self._lock = threading.Lock()

    def _answer(self, config, _):
        cap = self.capacity(config.args.values)
        return Outcome(url="http://127.0.0.1:1", steps=[step(cap, True), step(cap * 1.25, False)])

    def measure(self, config, profile, *, log_dir, slot=None, **kw):
        t0 = time.monotonic()
        time.sleep(self.seconds)
        with self._lock:
            out = super().measure(config, profile, log_dir=log_dir, **kw)
            self.ran.append((t0, time.monotonic(), slot, dict(config.args.values)))
        return out


def _runner(tmp_path, tiny_model, gpus, *, trials, space, baselines='builtin = ["vllm-defaults"]', seconds=0.4):
    path = _sim_study(tmp_path, tiny_model, gpus=gpus, trials=trials)
    text = path.read_text()
    start, end = text.index("[space]"), text.index("[workload]")
    text = text[:start] + "[space]\n" + space + "\n\n" + text[end:]
    start, end = text.index("[baselines]"), text.index("[remeasure]")
    text = text[:start] + "[baselines]\n" + baselines + "\n\n" + text[end:]
    path.write_text(text)
    d = load_study(path)
    measurer = Timed(d, seconds)
    steps = LoadSteps(dataclasses.replace(d.workload, tokenizer=str(tiny_model)))
    return StudyRun(d, measurer, steps), open_study(d), measurer


def test_trials_run_side_by_side_each_on_gpus_of_its_own(tmp_path, tiny_model):
    space = ('tensor_parallel_size = { type = "categorical", choices = [1, 2], default = 1 }\n'
             'max_num_seqs = { type = "int", low = 4, high = 256, log = true, default = 64 }')
    run, study, m = _runner(tmp_path, tiny_model, '"0-3"', trials=10, space=space)
    assert run.concurrency == 4
    run.optimize(study)
    assert len(m.ran) == len({t.number for t in study.trials if t.user_attrs.get("slot")}) >= 8
    overlapped = 0
    for i, (s0, e0, a, values) in enumerate(m.ran):
        assert len(a.gpus) == values.get("tensor_parallel_size", 1) and a.gpus[0] % len(a.gpus) == 0
        assert a.port == run.d.command.port + a.gpus[0]
        for s1, e1, b, _ in m.ran[i + 1:]:
            if s0 < e1 and s1 < e0:
                overlapped += 1
                assert not set(a.gpus) & set(b.gpus), (a, b)  # two trials at once never share a GPU
    assert overlapped >= 3
    for t in study.trials:
        if "slot" in t.user_attrs:
            gpus = t.user_attrs["slot"]["gpus"]
            assert t.user_attrs["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, gpus))


def test_a_config_sampled_while_it_is_measured_beside_is_not_measured_again(tmp_path, tiny_model):
    space = 'max_num_seqs = { type = "int", low = 4, high = 256, log = true, default = 64 }'
    run, study, m = _runner(tmp_path, tiny_model, '"0-1"', trials=2, space=space, baselines="builtin = []",
                            seconds=1.0)
    study.enqueue_trial({"max_num_seqs": 32})
    study.enqueue_trial({"max_num_seqs": 32}, skip_if_exists=False)
    run.optimize(study)
    assert len(m.ran) == 1
    twin = next(t for t in study.trials if "same_config_as" in t.user_attrs)
    assert twin.state == TrialState.COMPLETE and twin.value == study.trials[twin.user_attrs["same_config_as"]].value


def test_a_trial_wider_than_the_study_is_pruned_before_launch(tmp_path, tiny_model):
    space = 'tensor_parallel_size = { type = "categorical", choices = [4], default = 4 }'
    run, study, m = _runner(tmp_path, tiny_model, '"0-1"', trials=1, space=space)
    run.optimize(study)
    assert m.ran == []
    t = study.trials[0]
    assert t.state == TrialState.PRUNED and t.user_attrs["failure"] == "not started: it needs 4 GPUs and the study has 2 (0,1)"
    assert t.user_attrs["failure_engine_seconds"] == 0.0


# -- on vllm-sim: real engines side by side, and a stop signal among them --------------------------------------


def test_a_study_on_two_gpus_runs_real_engines_side_by_side(tmp_path, tiny_model):
    path = _sim_study(tmp_path, tiny_model, trials=5)
    r = subprocess.run([sys.executable, "-m", "autotune", "study", str(path)], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, env={**os.environ, "AUTOTUNE_STATE_DIR": str(tmp_path / "state")})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "up to 2 trials at once on GPUs 0,1, each on GPUs of its own" in r.stderr
    trials = [t for t in optuna.load_study(study_name="parallel", storage=f"sqlite:///{tmp_path}/studies.db").trials
              if "slot" in t.user_attrs]
    spans = [(t.datetime_start, t.datetime_complete, t.user_attrs["slot"]) for t in trials]
    both = [(a, b) for i, a in enumerate(spans) for b in spans[i + 1:] if a[0] < b[1] and b[0] < a[1]]
    assert both, spans  # at least two engines served at once
    for a, b in both:
        assert a[2]["gpus"] != b[2]["gpus"] and a[2]["port"] != b[2]["port"]
    for t in trials:  # the argv that ran names the slot's port
        assert t.user_attrs["argv"][t.user_attrs["argv"].index("--port") + 1] == str(t.user_attrs["slot"]["port"])
    assert (tmp_path / "parallel" / "best.yaml").is_file()


def test_a_sigterm_stops_every_trial_and_engine_of_a_parallel_study(tmp_path, tiny_model, cleanup):
    path = _sim_study(tmp_path, tiny_model, trials=4, step_duration="60s")
    state = tmp_path / "state"
    run = Autotune(tmp_path, "study", "study", str(path), state=state)
    cleanup[0].append(run.proc)
    deadline = time.monotonic() + 120
    records: list[dict] = []
    while len(records) < 2:  # two engines at once, each with its leftover record (pid, process group, port)
        run.alive()
        assert time.monotonic() < deadline, run.stderr[-3000:]
        time.sleep(0.2)
        with contextlib.suppress(OSError, ValueError):
            records = [json.loads(p.read_text()) for p in (state / "engines").glob("engine-*.json")]
    time.sleep(3.0)  # both replays under way
    took = run.signal_and_wait(signal.SIGTERM)
    assert run.proc.returncode == 143, run.stderr[-3000:]
    assert took < 10.0
    for rec in records:
        assert_nothing_left(rec, state)  # its group gone, its port free, its record removed
    assert "autotune: stopped by SIGTERM" in run.stderr
    trials = optuna.load_study(study_name="parallel", storage=f"sqlite:///{tmp_path}/studies.db").trials
    assert sum(t.state == TrialState.FAIL for t in trials) >= 2 and not any(t.state == TrialState.RUNNING for t in trials)


def test_the_re_measurement_runs_its_candidates_side_by_side(tmp_path, tiny_model):
    space = 'max_num_seqs = { type = "int", low = 4, high = 256, log = true, default = 64 }'
    run, study, m = _runner(tmp_path, tiny_model, '"0-3"', trials=6, space=space)
    m.capacity = lambda values: 1.0 + values["max_num_seqs"] / 256  # the candidates differ, within the noise
    run.optimize(study)
    searched = len(m.ran)
    verdict = run.remeasure(study)
    again = m.ran[searched:]
    assert verdict is not None and len(again) >= 2
    first = [r for r in again if r[0] < again[0][1]]  # the runs started with the first one
    assert len(first) >= 2 and len({r[2].gpus for r in first}) == len(first)  # at once, each on its own GPU
    assert len({tuple(sorted(r[3].items())) for r in first}) == len(first)  # distinct candidates in one batch


def test_the_dry_run_places_each_trial_and_a_bad_flag_says_how_to_write_it(tmp_path, tiny_model):
    path = _sim_study(tmp_path, tiny_model, gpus=None)
    env = {**os.environ, "AUTOTUNE_STATE_DIR": str(tmp_path / "state")}
    r = subprocess.run([sys.executable, "-m", "autotune", "study", str(path), "--gpus", "0-1", "--dry-run", "3"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["gpus"] for x in lines[:2]] == [[0], [1]]
    for x in lines:
        assert x["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, x["gpus"]))
        assert x["argv"][x["argv"].index("--port") + 1] != lines[0]["argv"][lines[0]["argv"].index("--port") + 1] \
            or x["gpus"] == lines[0]["gpus"]
    bad = subprocess.run([sys.executable, "-m", "autotune", "study", str(path), "--gpus", "0..3", "--dry-run"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "autotune: --gpus: '0..3' is not a GPU index or a range of them: write e.g. \"0-7\" or \"0,2,4-5\" "
        "(or \"inherit\")"
    ], bad.stderr
