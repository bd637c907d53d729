"""A second engine kind is one package plus one ``register`` call: the toy engine through the study code.

tests/toy_engine/ is a complete engine kind (its own flags, command line, failure text and
default space) around a fixed-timing server; here it is registered once and a real study runs
against it with autotune's own CLI code: load, flag checks, baselines, Optuna trials, launches,
replays, failure classification, re-measurement. Where the study code still assumes vLLM, the
test that shows it is marked xfail(strict=True) with the file and line in its reason: fixing
the leak turns it into an XPASS failure, which is the cue to drop the marker.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from autotune.engine import kind as kinds
from autotune.engine.args import EngineArgs, EngineCommand
from autotune.engine.failures import FailureClass, LogWatch
from autotune.engine.kind import get_kind, kind_for_command, register
from autotune.errors import ConfigError, UnknownFlagError
from autotune.study.definition import load_study
from tests.conftest import ROOT, free_port
from tests.toy_engine import MODULE, ToyKind

SLO_TPOT_MS = 10.0
FAST_ITL, SLOW_ITL, TOO_BIG_GB = 2.0, 25.0, 12  # the toy fits 8 GB

STUDY = """
name = "{name}"
slos = ["tpot<{slo}ms"]
seed = 0
storage = "sqlite:///{runs}/studies.db"
runs_dir = "{runs}"
{extra_top}
[engine]
kind = "toy"
command = "{python} -m tests.toy_engine.server"
model = "{model}"
platform = "{platform}"
port = {port}
nice = 0
startup_timeout = "20s"
{engine_extra}
[engine.env]
PYTHONPATH = "{root}"

[engine.args]
{args}

[workload]
scenario = "chat"
rate = 6
requests = 12
prompt_tokens = [16, 32]
output_tokens = [8, 16]
tokenizer = "{tokenizer}"

[objective]
max_steps = 2
step_duration = "1s"

[budget]
trials = {trials}

{baselines}

[remeasure]
top = 1
repeats = 1
"""

# vllm-defaults is the only builtin that a non-vLLM kind can run: it sets nothing (see the leak test below)
BASELINES = f"""
[baselines]
builtin = ["vllm-defaults"]
extra = [{{ name = "slow", values = {{ itl_ms = {SLOW_ITL} }} }},
         {{ name = "too-big", values = {{ memory_gb = {TOO_BIG_GB} }} }}]
"""


def write_study(tmp: Path, tokenizer: Path, *, name: str = "toy", trials: int = 5, args: str = "ttft_ms = 5.0",
                baselines: str = BASELINES, model: str = "toy-model", platform: str = "cpu",
                engine_extra: str = "", extra_top: str = "") -> Path:
    path = tmp / f"{name}.toml"
    path.write_text(STUDY.format(name=name, slo=SLO_TPOT_MS, runs=tmp, python=sys.executable, model=model,
                                 platform=platform, port=free_port(), root=ROOT, args=args, tokenizer=tokenizer,
                                 trials=trials, baselines=baselines, engine_extra=engine_extra, extra_top=extra_top))
    return path


def run_cli(argv: list[str], state: Path) -> tuple[int, str, str]:
    """``autotune ARGV`` in this process (the toy is registered only here), with its stdout and stderr."""
    from autotune.cli import main

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        mp.setenv("AUTOTUNE_STATE_DIR", str(state))
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def toy():
    """The one line that adds the kind; the registry is put back as it was afterwards."""
    registry, loaded = dict(kinds._REGISTRY), dict(kinds._LOADED)
    register("toy", "tests.toy_engine:ToyKind")
    try:
        yield get_kind("toy")
    finally:
        kinds._REGISTRY.clear()
        kinds._REGISTRY.update(registry)
        kinds._LOADED.clear()
        kinds._LOADED.update(loaded)


@pytest.fixture(scope="module")
def toy_study(toy, tiny_model, tmp_path_factory):
    """One real toy study, run once for the module: (exit code, stdout, stderr, the Optuna study, its dir)."""
    tmp = tmp_path_factory.mktemp("toy-study")
    path = write_study(tmp, tiny_model)
    rc, out, err = run_cli(["study", str(path)], tmp / "state")
    study = optuna.load_study(study_name="toy", storage=f"sqlite:///{tmp}/studies.db")
    return rc, out, err, study, tmp


def _why(rc: int, out: str, err: str) -> str:
    return f"rc={rc}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-5000:]}"


# -- the kind on its own ---------------------------------------------------------------------

def test_kind_for_command_picks_each_kind(toy):
    assert kind_for_command([sys.executable, "-m", MODULE]) is toy
    assert isinstance(toy, ToyKind) and toy.name == "toy"
    assert kind_for_command(["vllm", "serve"]).name == "vllm"
    assert kind_for_command(["/opt/venv/bin/vllm", "serve"]).name == "vllm"
    assert kind_for_command(["vllm-sim", "serve"]).name == "vllm-sim"
    assert kind_for_command([sys.executable, "-m", "autotune.sim.cli", "serve"]).name == "vllm-sim"
    # the study file's [engine] kind wins over the command line
    assert EngineCommand("m", ("vllm", "serve"), kind="toy").engine_kind is toy


def test_the_toy_has_its_own_flags_argv_and_failure_text(toy):
    cmd = EngineCommand("some-model", (sys.executable, "-m", MODULE), port=8123, kind="toy")
    table = cmd.flag_table()
    assert table.source == "toy" and table.lookup("--itl-ms") is not None
    assert table.lookup("--max-num-seqs") is None  # not vLLM's table
    argv = cmd.argv(EngineArgs({"itl_ms": 3.0, "memory_gb": 4}), table)
    assert argv == [sys.executable, "-m", MODULE, "--host", "127.0.0.1", "--port", "8123",
                    "--itl-ms", "3.0", "--memory-gb", "4"]
    with pytest.raises(UnknownFlagError) as e:
        cmd.argv(EngineArgs({"max_num_seqs": 8}), table)
    assert "--max-num-seqs" in str(e.value)
    with pytest.raises(ConfigError, match="--memory-gb expects int"):
        EngineArgs.from_cli(["--memory-gb", "lots"], table)

    spec = cmd.launch_spec(EngineArgs({}), table, Path("/nonexistent"), 5.0)
    watch = LogWatch(spec.failure_patterns)
    assert watch.feed("toy engine: serving") is None
    assert watch.feed("TOY ERROR: out of toy memory (asked for 12 GB)")[0] is FailureClass.OOM
    assert LogWatch(spec.failure_patterns).feed("OSError: [Errno 98] Address already in use")[0] \
        is FailureClass.PORT_IN_USE
    # vLLM's oom text means nothing coming from the toy
    assert LogWatch(spec.failure_patterns).feed("torch.OutOfMemoryError: CUDA out of memory") is None
    assert toy.block_sizes("cuda") is None and toy.block_sizes("cpu") is None


def test_an_unknown_toy_flag_is_refused_at_study_load(toy, tiny_model, tmp_path):
    path = write_study(tmp_path, tiny_model, args="ttft_ms = 5.0\nmax_num_seqs = 64")
    # load_study itself accepts [engine.args] as values; the CLI checks them against the kind's table
    # before anything is launched (the --dry-run path builds every argv without starting an engine)
    rc, out, err = run_cli(["study", str(path), "--dry-run", "2"], tmp_path / "state")
    assert rc == 2, _why(rc, out, err)
    assert "--max-num-seqs" in err and "engine flag" in err
    assert not (tmp_path / "toy" / "trials").exists()


def test_an_unknown_toy_flag_fails_the_study_before_any_launch(toy, tiny_model, tmp_path):
    path = write_study(tmp_path, tiny_model, args="ttft_ms = 5.0\nmax_num_seqs = 64")
    rc, out, err = run_cli(["study", str(path)], tmp_path / "state")
    assert rc == 2, _why(rc, out, err)
    assert "--max-num-seqs" in err
    assert not list((tmp_path / "toy" / "trials").glob("*/engine.*.log"))  # nothing was started


def test_an_unknown_kind_is_a_config_error(tiny_model, tmp_path):
    path = write_study(tmp_path, tiny_model)
    path.write_text(path.read_text().replace('kind = "toy"', 'kind = "no-such-engine"'))
    with pytest.raises(ConfigError, match="no-such-engine"):
        load_study(path)


# -- a real study against the toy ------------------------------------------------------------

def test_the_study_loads_with_the_toy_kind_and_its_default_space(toy, tiny_model, tmp_path):
    from autotune.study.runner import build_space

    d = load_study(write_study(tmp_path, tiny_model))
    assert d.command.engine_kind is toy and d.params is None
    space = build_space(d)
    assert space.names() == ["itl_ms", "memory_gb"]
    assert space.engine is toy


def test_a_study_runs_against_the_toy_engine(toy_study):
    rc, out, err, study, tmp = toy_study
    trials = study.trials
    assert len([t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]) == 5, _why(rc, out, err)
    by_name = {t.user_attrs.get("baseline"): t for t in trials if t.user_attrs.get("baseline")}
    assert {"vllm-defaults", "slow", "too-big"} <= set(by_name)

    # the toy's own out-of-memory line, classified by the toy's own patterns, prunes the trial
    big = by_name["too-big"]
    assert big.state == TrialState.PRUNED, _why(rc, out, err)
    assert big.user_attrs["failure_class"] == "oom"
    assert "out of toy memory" in big.user_attrs["failure"]
    assert "out of toy memory" in big.user_attrs["failure_excerpt"]
    assert big.user_attrs["capacity_rps"] == 0.0

    fast, slow = by_name["vllm-defaults"], by_name["slow"]
    assert fast.state == TrialState.COMPLETE and fast.user_attrs["capacity_rps"] > 0, _why(rc, out, err)
    assert slow.state == TrialState.COMPLETE and slow.user_attrs["capacity_rps"] == 0.0
    assert fast.value > slow.value == 0.0


def test_every_trial_is_judged_by_what_the_toy_did(toy_study):
    rc, out, err, study, _ = toy_study
    seen = 0
    for t in study.trials:
        if t.state not in (TrialState.COMPLETE, TrialState.PRUNED):
            continue
        seen += 1
        v = json.loads(json.dumps(t.user_attrs["engine_args"]["values"]))
        mem, itl = v.get("memory_gb", 4), v.get("itl_ms", FAST_ITL)
        if mem > 8:
            assert t.state == TrialState.PRUNED and t.user_attrs["failure_class"] == "oom", t.number
            assert "out of toy memory" in t.user_attrs["failure"]
            continue
        assert "failure_class" not in t.user_attrs, (t.number, t.user_attrs.get("failure"))
        steps = t.user_attrs["steps"]
        assert steps, t.number
        tpot_ms = steps[0]["tpot_p95"] * 1000
        assert abs(tpot_ms - itl) < 3.0, (t.number, itl, tpot_ms)  # the toy runs at the ITL it was given
        if itl < SLO_TPOT_MS - 2:
            assert t.user_attrs["capacity_rps"] > 0, (t.number, itl, steps)
        elif itl > SLO_TPOT_MS + 2:
            assert t.user_attrs["capacity_rps"] == 0.0, (t.number, itl, steps)
    assert seen == 5


def test_the_argv_is_the_toys_command_line(toy_study):
    rc, out, err, study, _ = toy_study
    for t in study.trials:
        if "argv" not in t.user_attrs:
            continue
        argv = t.user_attrs["argv"]
        assert argv[:3] == [sys.executable, "-m", MODULE], argv
        assert argv[3:7] == ["--host", "127.0.0.1", "--port", argv[6]], argv  # no model positional
        assert "toy-model" not in argv
        assert "--ttft-ms" in argv and "--itl-ms" in argv and "--memory-gb" in argv
        assert not any(a.startswith("--") and a not in ("--host", "--port", "--ttft-ms", "--itl-ms", "--memory-gb")
                       for a in argv), argv


def test_the_toy_study_is_remeasured(toy_study):
    rc, out, err, study, _ = toy_study
    verdict = study.user_attrs.get("remeasure")
    assert verdict is not None, _why(rc, out, err)
    assert verdict["baseline"] == "baseline vllm-defaults"
    assert all(c["median"] > 0 for c in verdict["candidates"]), verdict


# -- where the study code still assumes vLLM (xfail strict: each is a leak; see its reason) ----

@pytest.mark.xfail(strict=True, raises=ConfigError, reason=(
    "LEAK autotune/cli.py:314 cmd_study always calls study/outputs.py:write_best, which calls "
    "engine.render_config (kind.py: the base raises ConfigError 'has no config file format to publish'); "
    "a kind without a config file format cannot finish `autotune study` (exit 2 after the study is done), "
    "and outputs.py:50 / cli.py:315 print 'vllm serve --config' for every kind"))
def test_a_toy_study_writes_its_best_command_line(toy_study):
    rc, out, err, study, tmp = toy_study
    if rc == 2 and "no config file format" in err:
        raise ConfigError(err.strip().splitlines()[-1])
    assert rc == 0, _why(rc, out, err)
    assert (tmp / "toy" / "best-command.sh").is_file()
    assert "vllm serve" not in out


@pytest.mark.xfail(strict=True, raises=UnknownFlagError, reason=(
    "LEAK autotune/study/definition.py:66,222 default [baselines] builtin = vllm-defaults, xinference-4.1, "
    "xinference-legacy for every kind; study/baselines.py:24-29 BUILTIN holds vLLM flag names "
    "(gpu_memory_utilization, max_num_seqs, block_size, enable_chunked_prefill, enable_prefix_caching), "
    "so a toy study without its own [baselines] section stops with UnknownFlagError --max-num-seqs"))
def test_a_toy_study_needs_no_baselines_section(toy, tiny_model, tmp_path):
    path = write_study(tmp_path, tiny_model, baselines="")
    rc, out, err = run_cli(["study", str(path), "--dry-run", "4"], tmp_path / "state")
    if rc == 2 and "engine flag" in err:
        raise UnknownFlagError(err.split("engine flag ")[1].split()[0], err.strip())
    assert rc == 0, _why(rc, out, err)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "LEAK autotune/study/runner.py:176-183 (and study/dryrun.py:37) run study/precheck.py for every kind "
    "whose model is a local directory; precheck reads vLLM's flags and defaults (gpu_memory_utilization "
    "0.92, kv_cache_memory_bytes, tensor/pipeline_parallel_size, max_model_len, kv_cache_dtype, "
    "VLLM_CPU_KVCACHE_SPACE) and prunes toy trials as 'oom' before launch; precheck is no EngineKind hook"))
def test_vllms_memory_precheck_does_not_judge_the_toy(toy, tiny_model, tmp_path):
    # the toy serves no weights: a model directory and a small declared GPU must not matter to it
    path = write_study(tmp_path, tiny_model, model=str(tiny_model), platform="cuda",
                       engine_extra='\n[engine.gpu]\nname = "Toy GPU"\nmemory = "8MiB"\n')
    rc, out, err = run_cli(["study", str(path), "--dry-run", "3"], tmp_path / "state")
    assert rc == 0, _why(rc, out, err)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 3
    assert not [x["precheck"] for x in lines if "precheck" in x]
