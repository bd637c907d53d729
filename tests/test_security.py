"""Security: trust_remote_code in no spelling without the study's leave, no secret in any output,
files with state or configs readable by their owner only (0600; 0640 where a group reads them).

The engine is vllm-sim behind a wrapper named ``vllm-sim`` (so autotune treats it as vllm-sim)
that writes the secrets it was given to a file: the engine must still get the real values.
"""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.engine.args import EngineArgs

from autotune.engine.command import EngineCommand
from autotune.engine.secrets import REDACTED, redact, reveal
from autotune.engine.vllm.flags import bundled_table
from autotune.errors import ConfigError
from tests.conftest import free_port
from tests.test_cli import trace  # noqa: F401  (a small text trace)

TOKEN, CREDS = "hf_sekrit_token_1234", "sekrit_creds_5678"  # HF_TOKEN by its name; MY_CREDS by secret_env
ROOT = Path(__file__).resolve().parents[1]


def autotune(*args, timeout=120, cwd=ROOT, **env):
    return subprocess.run([sys.executable, "-m", "autotune", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env={**os.environ, **env})


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def one_line_exit_2(r, needle):
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.fixture(scope="module")
def table():
    return bundled_table("0.33")


@pytest.fixture
def sim_wrapper(tmp_path):
    """``vllm-sim`` that records the secrets it got (one line per launch), then is vllm-sim."""
    seen = tmp_path / "seen.txt"
    exe = tmp_path / "bin" / "vllm-sim"
    exe.parent.mkdir()
    exe.write_text(f'#!/bin/sh\nprintf "%s %s\\n" "$HF_TOKEN" "$MY_CREDS" >> {seen}\n'
                   f'exec {sys.executable} -m autotune.sim.cli --gpu a10-24gb --time-scale 0.01 "$@"\n')
    exe.chmod(0o755)
    return exe, seen


# --- trust_remote_code, every spelling, every place -----------------------------------------

REFUSED_ARGS = [{"trust_remote_code": True}, {"trust-remote-code": True}, {"--trust-remote-code": True}]


@pytest.mark.parametrize("values", REFUSED_ARGS)
def test_trust_remote_code_is_refused_in_every_spelling_of_an_engine_arg(table, values):
    args = EngineArgs(values)
    assert args.values == {"trust_remote_code": True}  # one name, whatever the spelling
    with pytest.raises(ConfigError, match="allow_trust_remote_code"):
        EngineCommand(model="m").argv(args, table)
    assert "--trust-remote-code" in EngineCommand(model="m", allow_trust_remote_code=True).argv(args, table)


@pytest.mark.parametrize("tokens", [["--trust-remote-code"], ["--trust_remote_code"]])
def test_trust_remote_code_is_refused_on_the_command_line(table, tokens):
    args = EngineArgs.from_cli(tokens, table)
    with pytest.raises(ConfigError, match="allow_trust_remote_code"):
        EngineCommand(model="m").argv(args, table)


@pytest.mark.parametrize("word", ["--trust-remote-code", "--trust_remote_code"])
def test_trust_remote_code_is_refused_in_the_engine_command_itself(table, word):
    with pytest.raises(ConfigError, match="allow_trust_remote_code"):
        EngineCommand(model="m", command=("vllm", "serve", word)).argv(EngineArgs(), table)
    assert word in EngineCommand(model="m", command=("vllm", "serve", word), allow_trust_remote_code=True).argv(
        EngineArgs(), table)


@pytest.mark.parametrize("values", [{"trust-remote-code": False}, {"no_trust_remote_code": True}])
def test_turning_trust_remote_code_off_needs_no_leave(table, values):
    argv = EngineCommand(model="m").argv(EngineArgs(values), table)
    assert "--no-trust-remote-code" in argv and "--trust-remote-code" not in argv


def test_managed_flags_are_refused_in_every_spelling(table):
    for values in ({"port": 9000}, {"--port": 9000}):
        with pytest.raises(ConfigError, match="autotune picks the engine port"):
            EngineCommand(model="m").argv(EngineArgs(values), table)


STUDY = """
name = "trust"
storage = "sqlite:///{tmp}/studies.db"
runs_dir = "{tmp}/runs"
slos = ["ttft<5s"]
seed = 0

[engine]
command = "{command} serve"
kind = "vllm-sim"
model = "llama-3.1-8b"
platform = "cuda"
port = {port}
startup_timeout = "60s"
{engine_extra}

[engine.gpu]
name = "NVIDIA A10"
memory = "23028MiB"

[engine.env]
HF_TOKEN = "{token}"
MY_CREDS = "{creds}"
PLAIN_SETTING = "visible"

[engine.args]
max_model_len = 4096
tokenizer = "{model}"
{args_extra}

[space]
max_num_seqs = {{ type = "int", low = 8, high = 64, default = 64 }}
{space_extra}

[workload]
scenario = "high-concurrency"
rate = 2
requests = 12
prompt_tokens = [16, 64]
output_tokens = [8, 16]

[objective]
max_steps = 2
step_duration = "2s"

[budget]
trials = 1

[baselines]
builtin = ["vllm-defaults"]
{baselines_extra}

[remeasure]
top = 1
repeats = 1
"""


def study_file(tmp_path, tiny_model, command=None, engine_extra="", args_extra="", space_extra="",
               baselines_extra="") -> Path:
    p = tmp_path / "trust.toml"
    p.write_text(STUDY.format(tmp=tmp_path, command=command or f"{sys.executable} -m autotune.sim.cli",
                              port=free_port(), model=tiny_model, token=TOKEN, creds=CREDS,
                              engine_extra=engine_extra, args_extra=args_extra, space_extra=space_extra,
                              baselines_extra=baselines_extra))
    return p


PLACES = {
    "engine.args": {"args_extra": '"trust-remote-code" = true'},
    "space": {"space_extra": '"trust-remote-code" = { type = "bool", default = true }'},
    "baselines.extra": {"baselines_extra": 'extra = [{ name = "x", values = { "trust-remote-code" = true } }]'},
    "baselines.production": {"baselines_extra": 'production = { "trust_remote_code" = true }'},
}


@pytest.mark.parametrize("place", sorted(PLACES))
def test_a_study_cannot_trust_remote_code_without_leave(tmp_path, tiny_model, place):
    path = study_file(tmp_path, tiny_model, **PLACES[place])
    one_line_exit_2(autotune("study", str(path), "--dry-run", "2"), "allow_trust_remote_code")
    allowed = study_file(tmp_path, tiny_model, engine_extra="allow_trust_remote_code = true", **PLACES[place])
    r = autotune("study", str(allowed), "--dry-run", "2")
    assert r.returncode == 0, r.stderr
    assert any("--trust-remote-code" in json.loads(line)["argv"] for line in r.stdout.splitlines())


def test_a_study_run_stops_before_launching_an_engine_that_trusts_remote_code(tmp_path, tiny_model, sim_wrapper):
    exe, seen = sim_wrapper
    path = study_file(tmp_path, tiny_model, command=str(exe), args_extra='"trust-remote-code" = true')
    # run from tmp_path: a study without runs_dir writes its log and report under ./runs
    r = autotune("study", str(path), timeout=120, cwd=tmp_path, AUTOTUNE_STATE_DIR=str(tmp_path / "state"))
    assert r.returncode == 2 and "allow_trust_remote_code" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
    assert not seen.exists()  # nothing was launched


@pytest.mark.parametrize("engine_cmd,engine_args", [
    ("", ["--trust-remote-code"]),
    ("", ["--trust_remote_code"]),
    (" --trust-remote-code", []),
])
def test_bench_cannot_trust_remote_code_without_leave(tmp_path, trace, sim_wrapper, engine_cmd, engine_args):
    exe, seen = sim_wrapper
    r = autotune("bench", "--model", "llama-3.1-8b", "--engine-cmd", f"{exe} serve{engine_cmd}", "--workload",
                 str(trace), "--log-dir", str(tmp_path / "logs"), "--", *engine_args)
    one_line_exit_2(r, "allow_trust_remote_code")
    assert not seen.exists()


# --- secrets --------------------------------------------------------------------------------

def test_secret_names():
    env = {"HF_TOKEN": "a", "OPENAI_API_KEY": "b", "aws_secret_access_key": "c", "DB_Password": "d",
           "My_Creds": "e", "VLLM_CPU_KVCACHE_SPACE": "4"}
    shown = redact(env, ["MY_CREDS"])
    assert shown == {**{k: REDACTED for k in env}, "VLLM_CPU_KVCACHE_SPACE": "4"}
    assert reveal(shown, env) == env
    assert reveal(shown, {}) == shown  # nothing to reveal from


def test_dry_run_shows_no_secret(tmp_path, tiny_model):
    path = study_file(tmp_path, tiny_model, engine_extra='secret_env = ["MY_CREDS"]')
    r = autotune("study", str(path), "--dry-run", "2")
    assert r.returncode == 0, r.stderr
    assert TOKEN not in r.stdout + r.stderr and CREDS not in r.stdout + r.stderr
    for line in map(json.loads, r.stdout.splitlines()):
        assert line["env"] == {"HF_TOKEN": REDACTED, "MY_CREDS": REDACTED, "PLAIN_SETTING": "visible"}


def test_bench_json_shows_no_secret_and_the_engine_got_it(tmp_path, tiny_model, trace, sim_wrapper):
    exe, seen = sim_wrapper
    out = tmp_path / "out.json"
    r = autotune("bench", "--model", "llama-3.1-8b", "--engine-cmd", f"{exe} serve", "--port", str(free_port()),
                 "--env", f"HF_TOKEN={TOKEN}", "--env", "PLAIN_SETTING=visible", "--workload", str(trace),
                 "--slo", "ttft<10s", "--json", str(out), "--log-dir", str(tmp_path / "logs"),
                 "--allow-trust-remote-code", "--", "--trust-remote-code", "--tokenizer", str(tiny_model),
                 "--max-model-len", "4096",
                 timeout=180, AUTOTUNE_STATE_DIR=str(tmp_path / "state"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads(out.read_text())
    assert TOKEN not in out.read_text() + r.stdout + r.stderr
    assert result["env"] == {"HF_TOKEN": REDACTED, "PLAIN_SETTING": "visible"}
    assert "--trust-remote-code" in result["argv"]  # allowed: the user said so
    assert seen.read_text().split() == [TOKEN]


def _files(root: Path):
    return [p for p in root.rglob("*") if p.is_file()]


def test_a_study_stores_and_writes_no_secret_and_the_engine_got_it(tmp_path, tiny_model, sim_wrapper):
    import optuna

    exe, seen = sim_wrapper
    path = study_file(tmp_path, tiny_model, command=str(exe), engine_extra='secret_env = ["MY_CREDS"]')
    r = autotune("study", str(path), timeout=300, AUTOTUNE_STATE_DIR=str(tmp_path / "state"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert TOKEN not in r.stdout + r.stderr and CREDS not in r.stdout + r.stderr

    study = optuna.load_study(study_name="trust", storage=f"sqlite:///{tmp_path}/studies.db")
    assert study.trials
    for t in study.trials:  # what the dashboard and the report show
        assert t.user_attrs["env"] == {"HF_TOKEN": REDACTED, "MY_CREDS": REDACTED, "PLAIN_SETTING": "visible"}
        assert t.user_attrs["engine_args"]["env"] == t.user_attrs["env"]
        assert TOKEN not in json.dumps(t.user_attrs) and CREDS not in json.dumps(t.user_attrs)
    db = tmp_path / "studies.db"
    assert TOKEN.encode() not in db.read_bytes() and CREDS.encode() not in db.read_bytes()
    assert mode(db) == 0o600

    # every launch, the trial's and the re-measurement's, got the real values
    launches = seen.read_text().splitlines()
    assert len(launches) >= 2 and set(launches) == {f"{TOKEN} {CREDS}"}

    run = tmp_path / "runs" / "trust"
    best = json.loads((run / "best.json").read_text())
    assert best["env"] == {"HF_TOKEN": REDACTED, "MY_CREDS": REDACTED, "PLAIN_SETTING": "visible"}
    for p in _files(tmp_path / "runs"):  # best.json, best.yaml, logs, artifacts, requests
        if p.name != "best-command.sh":
            assert TOKEN.encode() not in p.read_bytes() and CREDS.encode() not in p.read_bytes(), p
    for name in ("best.json", "best.yaml", "best-command.sh"):
        assert mode(run / name) == 0o600, name


def test_best_command_keeps_the_real_values_and_is_private(tmp_path):
    from optuna.trial import TrialState

    from autotune.engine.kind import get_kind
    from autotune.study.outputs import write_best
    from autotune.study.records import Attr, TrialRecord

    env = {"HF_TOKEN": REDACTED, "MY_CREDS": REDACTED, "PLAIN_SETTING": "visible"}
    t = TrialRecord(3, TrialState.COMPLETE, {}, (1.0,), {
        Attr.ARGV: ["vllm", "serve", "m", "--max-num-seqs", "8"], Attr.CAPACITY_RPS: 1.0,
        Attr.ENGINE_ARGS: {"values": {"max_num_seqs": 8}, "env": env}})
    paths = write_best(t, "m", get_kind("vllm"), tmp_path / "a", real_env={"HF_TOKEN": TOKEN, "MY_CREDS": CREDS})
    command = paths["command"].read_text()
    assert f"HF_TOKEN={TOKEN}" in command and f"MY_CREDS={CREDS}" in command
    for p in paths.values():
        assert mode(p) == 0o600
        if p != paths["command"]:
            assert TOKEN not in p.read_text() and CREDS not in p.read_text()
    # without the real values the command takes them from the environment it runs in, and says so if unset
    command = write_best(t, "m", get_kind("vllm"), tmp_path / "b")["command"]
    assert REDACTED not in command.read_text()
    r = subprocess.run(["sh", str(command)], capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
    assert r.returncode != 0 and "HF_TOKEN" in r.stderr


# --- file modes -----------------------------------------------------------------------------

@pytest.fixture
def open_umask():
    """umask 0: a mode that comes out right is autotune's doing, not the umask's."""
    old = os.umask(0)
    yield
    os.umask(old)


def test_atomic_write_is_private_by_default(tmp_path, open_umask):
    from autotune.locations import atomic_write

    atomic_write(tmp_path / "a", "x")
    assert mode(tmp_path / "a") == 0o600
    (tmp_path / "b").write_text("old")
    (tmp_path / "b").chmod(0o644)
    atomic_write(tmp_path / "b", "new", 0o640)
    assert mode(tmp_path / "b") == 0o640 and (tmp_path / "b").read_text() == "new"
    os.umask(0o077)  # an explicit group-readable mode survives a strict umask
    atomic_write(tmp_path / "c", "x", 0o640)
    assert mode(tmp_path / "c") == 0o640


def test_daemon_state_and_history_are_private(tmp_path, open_umask):
    from autotune.daemon.state import DaemonState, StateStore
    from autotune.publish.history import History

    store = StateStore(tmp_path / "state")
    store.save(DaemonState(since=0.0))
    store.request_retune("test")
    assert mode(store.path) == 0o600 and mode(store.retune_flag) == 0o600
    history = History(tmp_path / "history")
    history.add("adopted", {"max_num_seqs": 8})
    files = _files(tmp_path / "history")
    assert files and all(mode(p) == 0o600 for p in files)


def test_engine_records_are_private(tmp_path, open_umask):
    from autotune.engine.leftovers import EngineRecord, write_record

    rec = EngineRecord(**{**{f: 0 for f in EngineRecord.__dataclass_fields__}, "argv": ["vllm"], "port": 8100})
    assert mode(write_record(tmp_path, rec)) == 0o600


def test_production_config_is_readable_by_the_vllm_group_only(tmp_path, open_umask, monkeypatch, table):
    import autotune.publish.vllm_config as vc

    monkeypatch.setattr(vc, "wait_healthy", lambda url, timeout: None)
    target = vc.VllmConfigTarget(tmp_path / "production.yaml", "m", ("true",), "http://127.0.0.1:1", table)
    target.deploy({"max_num_seqs": 8})
    assert mode(target.config_path) == 0o640  # the vllm unit's user reads it through its group


def test_the_study_database_is_private(tmp_path, open_umask, tiny_model):
    from dataclasses import replace

    from autotune.study.definition import load_study
    from autotune.study.storage import open_study

    d = load_study(study_file(tmp_path, tiny_model))
    open_study(d)
    assert mode(tmp_path / "studies.db") == 0o600
    (tmp_path / "old.db").write_bytes((tmp_path / "studies.db").read_bytes())
    (tmp_path / "old.db").chmod(0o644)  # made by an earlier autotune
    open_study(replace(d, storage=f"sqlite:///{tmp_path}/old.db"))
    assert mode(tmp_path / "old.db") == 0o600
