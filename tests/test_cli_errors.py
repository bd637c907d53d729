"""Bad input on the command line ends in one line and exit 2, never a traceback (issue 11).

Each case runs ``autotune.cli.main`` in-process: an exception that escaped it would fail the test
with its traceback. None of them starts an engine or a server: the engine command is a path that
does not exist, the URLs point at nothing.
"""

import importlib.util
import json
import subprocess
import sys

import optuna
import pytest

from autotune.cli import main
from tests.conftest import free_port
from tests.test_cli import trace  # noqa: F401  (a trace of prompts with arrival times)

NO_ENGINE = "/nonexistent/autotune-test/vllm serve"


def one_line_exit_2(capsys, *argv: str) -> str:
    """Run the command; it must exit 2 with exactly one line on stderr, ``autotune: ...``; that line."""
    try:
        code = main([str(x) for x in argv])
    except SystemExit as e:  # argparse's own usage errors
        code = e.code
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert code == 2, (code, out)
    assert len(lines) == 1 and lines[0].startswith("autotune: "), out.err
    return lines[0]


@pytest.fixture(autouse=True)
def _state(state_dir, tmp_path, monkeypatch):
    """Engine records and daemon state go to the test's own directory, and so do the runs/ of the studies
    here, which name no runs_dir (the default is relative to the working directory)."""
    monkeypatch.chdir(tmp_path)


STUDY = """
name = "s"
slos = ["ttft<1s"]
[engine]
command = "{command}"
model = "m"
platform = "cpu"
[workload]
{workload}
"""


@pytest.fixture
def study_file(tmp_path, trace):
    def make(workload=f'trace = "{trace}"', command=NO_ENGINE):
        p = tmp_path / "s.toml"
        p.write_text(STUDY.format(command=command, workload=workload))
        return p

    return make


# --- study storage ------------------------------------------------------------------------------

@pytest.mark.parametrize("url,needle", [
    ("nodb://u@h/x", "no dialect"),  # sqlalchemy knows no such database
    ("mysql://u@127.0.0.1/x", "driver is not installed"),  # a dialect whose driver is absent
    ("not a url", "does not parse"),
])
def test_report_storage_without_a_driver(capsys, study_file, url, needle):
    if needle == "driver is not installed":  # autotune installs no MySQL driver: this case needs none here
        assert importlib.util.find_spec("MySQLdb") is None, "a MySQL driver is installed: pick another dialect"
    assert needle in one_line_exit_2(capsys, "report", study_file(), "--storage", url)


def test_study_storage_without_a_driver(capsys, study_file):
    assert "no dialect" in one_line_exit_2(capsys, "study", study_file(), "--storage", "nodb://u@h/x")


def test_report_storage_in_a_directory_that_does_not_exist(capsys, study_file, tmp_path):
    line = one_line_exit_2(capsys, "report", study_file(), "--storage", f"sqlite:///{tmp_path}/no/such/dir/s.db")
    assert "no study database" in line and "autotune study" in line
    assert not (tmp_path / "no").exists()  # and nothing was made on the way


def test_study_storage_in_a_directory_that_cannot_exist(capsys, study_file, tmp_path):
    (tmp_path / "a-file").write_text("")
    line = one_line_exit_2(capsys, "study", study_file(), "--storage", f"sqlite:///{tmp_path}/a-file/dir/s.db")
    assert "a-file" in line


def test_report_of_a_study_that_does_not_exist(capsys, study_file, tmp_path):
    storage = f"sqlite:///{tmp_path}/s.db"
    optuna.create_study(study_name="other", storage=storage)
    line = one_line_exit_2(capsys, "report", study_file(), "--storage", storage, "--study-name", "nope")
    assert "no study 'nope'" in line and "other" in line


# --- the daemon's history ------------------------------------------------------------------------

@pytest.fixture
def daemon_file(tmp_path):
    (tmp_path / "staging.toml").write_text(STUDY.format(command=NO_ENGINE, workload='scenario = "chat"\nrate = 1'))
    p = tmp_path / "daemon.toml"
    p.write_text(f'name = "d"\nslos = ["ttft<1s"]\n[production]\nurl = "http://127.0.0.1:9"\n'
                 f'config = "{tmp_path}/p.yaml"\nmodel = "m"\nrestart = ["/bin/true"]\n'
                 f'[staging]\nstudy = "staging.toml"\n[metrics]\nlisten = ""\n')
    return p


@pytest.mark.parametrize("to", ["999", "0", "-3"])
def test_rollback_to_an_entry_that_does_not_exist(capsys, daemon_file, to):
    line = one_line_exit_2(capsys, "rollback", "--config", daemon_file, "--to", to)
    assert "entry" in line


def test_rollback_with_no_history(capsys, daemon_file):
    assert "roll back to" in one_line_exit_2(capsys, "rollback", "--config", daemon_file)


# --- workloads -------------------------------------------------------------------------------------

def test_trace_that_is_not_utf8(capsys, tmp_path):
    p = tmp_path / "latin1.jsonl"
    p.write_bytes('{"arrival_s": 0, "prompt": "caf\u00e9", "output_tokens": 4}\n'.encode("latin-1"))
    line = one_line_exit_2(capsys, "replay", "--url", "http://127.0.0.1:9", "--workload", p)
    assert "latin1.jsonl" in line and "UTF-8" in line


@pytest.mark.parametrize("flag,value", [
    ("--burstiness", "0"), ("--burstiness", "-1"), ("--burstiness", "nan"), ("--burstiness", "inf"),
    ("--rate", "0"), ("--rate", "-2"), ("--rate", "nan"), ("--seed", "-1"), ("--load", "nan"),
    ("--request-timeout", "0"), ("--warmup", "-1"), ("--max-concurrency", "0"), ("--output-tokens", "0"),
    ("--prompt-tokens", "99999999999"),
])
def test_workload_numbers_out_of_range(capsys, flag, value):
    line = one_line_exit_2(capsys, "replay", "--url", "http://127.0.0.1:9", "--scenario", "chat",
                           *(["--rate", "1"] if flag != "--rate" else []), flag, value)
    assert flag.lstrip("-").split("-")[0] in line.lower()


def test_tokenizer_that_is_not_a_tokenizer(capsys, tmp_path):
    for text in ("just text", '{"json": "but not a tokenizer"}'):
        p = tmp_path / "tokenizer.json"
        p.write_text(text)
        for given in (p, tmp_path):  # the file, or the directory that holds it
            line = one_line_exit_2(capsys, "replay", "--url", "http://127.0.0.1:9", "--scenario", "chat",
                                   "--rate", "1", "--tokenizer", given)
            assert "not a tokenizer" in line and str(p) in line


def test_sharegpt_skips_are_counted_on_stderr(tmp_path, capsys):
    p = tmp_path / "s.json"
    p.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"}]},
        {"conversations": [{"from": "gpt", "value": "I speak first"}]},
        {"conversations": [{"from": "system", "value": "be brief"}, {"from": "gpt", "value": "ok"}]},
    ]))

    class Reached(Exception):
        pass

    def measured(*a, **kw):
        raise Reached

    with pytest.raises(Reached):  # where replay would start sending: main's stand-in for measure_url
        main(["replay", "--url", "http://127.0.0.1:9", "--workload", str(p), "--rate", "1", "--output-tokens", "8"],
             measure_url=measured)
    err = capsys.readouterr().err
    assert "skipped 2 conversations" in err and "s.json" in err


# --- the engine command ------------------------------------------------------------------------------

def test_engine_cmd_with_an_unbalanced_quote(capsys, trace):
    line = one_line_exit_2(capsys, "bench", "--model", "m", "--engine-cmd", "vllm 'serve", "--workload", trace)
    assert "quote" in line


def test_engine_cmd_that_does_not_exist(capsys, trace, tmp_path):
    line = one_line_exit_2(capsys, "bench", "--model", "m", "--engine-cmd", NO_ENGINE, "--workload", trace,
                           "--port", free_port(), "--log-dir", tmp_path / "logs")
    assert "cannot run /nonexistent/autotune-test/vllm" in line


def test_vllm_version_picks_a_bundled_table(capsys, trace, tmp_path):
    # vLLM not installed (the engine command names nothing): --vllm-version picks the flag table...
    for version in ("9.9", "banana", ""):
        line = one_line_exit_2(capsys, "bench", "--model", "m", "--engine-cmd", NO_ENGINE, "--vllm-version", version,
                               "--workload", trace)
        assert "0.32" in line and "0.33" in line
    # ... and a known one checks the flags against it; the launch then says the engine is not there
    line = one_line_exit_2(capsys, "bench", "--model", "m", "--engine-cmd", NO_ENGINE, "--vllm-version", "0.33.1",
                           "--workload", trace, "--port", free_port(), "--log-dir", tmp_path / "logs")
    assert "cannot run" in line


@pytest.mark.parametrize("port", ["0", "70000", "-1", "http"])
def test_bench_port_out_of_range(capsys, trace, port):
    assert "--port" in one_line_exit_2(capsys, "bench", "--model", "m", "--engine-cmd", NO_ENGINE, "--port", port,
                                       "--workload", trace)


# --- capture -----------------------------------------------------------------------------------------

def capture(*args):
    """A subprocess: with arguments that were wrongly accepted it would serve, and the timeout shows it."""
    r = subprocess.run([sys.executable, "-m", "autotune", "capture", *map(str, args)], capture_output=True,
                       text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("autotune: "), r.stderr
    return lines[0]


@pytest.mark.parametrize("listen", ["127.0.0.1:70000", "127.0.0.1:0", ":8001", "127.0.0.1:\u00b2", "nohost"])
def test_capture_listen_out_of_range(tmp_path, listen):
    assert "--listen" in capture("--listen", listen, "--upstream", "http://127.0.0.1:9", "--out", tmp_path / "t.jsonl")


def test_capture_out_in_a_missing_directory(tmp_path):
    line = capture("--listen", f"127.0.0.1:{free_port()}", "--upstream", "http://127.0.0.1:9",
                   "--out", tmp_path / "missing" / "t.jsonl")
    assert "does not exist" in line and "missing" in line


def test_capture_upstream_that_is_not_a_url(tmp_path):
    line = capture("--listen", f"127.0.0.1:{free_port()}", "--upstream", "127.0.0.1:8000", "--out", tmp_path / "t.jsonl")
    assert "--upstream" in line or "upstream" in line


def test_capture_listen_address_in_use(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        line = capture("--listen", f"127.0.0.1:{s.getsockname()[1]}", "--upstream", "http://127.0.0.1:9",
                       "--out", tmp_path / "t.jsonl")
    assert "in use" in line


# --- study --dry-run ---------------------------------------------------------------------------------

@pytest.mark.parametrize("workload,needle", [
    ('trace = "missing.jsonl"', "does not exist"),
    ('scenario = "nope"\nrate = 1', "unknown scenario"),
    ('scenario = "chat"\nrate = 0', "rate"),
    ('scenario = "chat"\nrate = 1\nburstiness = 0', "burstiness"),
])
def test_dry_run_checks_the_workload(capsys, study_file, workload, needle):
    assert needle in one_line_exit_2(capsys, "study", study_file(workload), "--dry-run")


@pytest.mark.parametrize("n", ["-1", "0", "x"])
def test_dry_run_count(capsys, study_file, n):
    assert "--dry-run" in one_line_exit_2(capsys, "study", study_file(), "--dry-run", n)


def test_dry_run_still_prints_the_trials(capsys, study_file):
    assert main(["study", str(study_file()), "--dry-run", "2"]) == 0
    out = capsys.readouterr()
    lines = out.out.strip().splitlines()
    assert len(lines) == 2 and all("argv" in json.loads(x) for x in lines)
    # a vLLM study simulates first where it can, and that reorders the trials: the dry run says what the real study
    # will decide here, as it decides it (a model whose config.json is nowhere has no shape to simulate)
    assert "autotune: the real study will not simulate first: no model shape" in out.err, out.err
    path = study_file()
    path.write_text(path.read_text().replace("[workload]", "[objective]\nsimulate_first = false\n[workload]"))
    assert main(["study", str(path), "--dry-run", "2"]) == 0
    assert "simulate first" not in capsys.readouterr().err


# --- the boundary itself -----------------------------------------------------------------------------

def _not_utf8():
    b"caf\xe9".decode()


def _yaml():
    import yaml

    yaml.safe_load("model: [unclosed")


def _no_study(tmp_path):
    optuna.load_study(study_name="nope", storage=f"sqlite:///{tmp_path}/s.db")


def _no_directory(tmp_path):
    optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path}/no/dir/s.db")


def _not_a_database(tmp_path):
    (tmp_path / "text.db").write_text("not sqlite " * 100)
    optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path}/text.db")


def _quote():
    import shlex

    shlex.split("vllm 'serve")


def _no_program():
    subprocess.run(["/nonexistent/autotune-test/program"])


def _no_file(tmp_path):
    open(tmp_path / "missing" / "f")


def _bad_host():
    import socket

    socket.getaddrinfo("no-such-host.invalid", 80)


@pytest.mark.parametrize("raise_it,needle", [
    (_not_utf8, "not UTF-8"), (lambda: json.loads("{"), "JSON file does not parse"), (_yaml, "YAML file does not parse"),
    (_no_study, "not in its storage"), (_no_directory, "cannot open the study storage"),
    (_not_a_database, "study storage refused"), (_quote, "close the quote"),
    (_no_program, "cannot run /nonexistent/autotune-test/program"), (_no_file, "no such file or directory (check the path)"),
    (_bad_host, "check the host name"),
])
def test_outside_exceptions_caused_by_input_become_config_errors(tmp_path, raise_it, needle):
    from autotune.boundary import input_errors
    from autotune.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        with input_errors():
            raise_it(tmp_path) if raise_it.__code__.co_argcount else raise_it()
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert e.value.__cause__ is not None  # raise ... from: the original stays for a debugger


@pytest.mark.parametrize("raise_it", [lambda: int("x"), lambda: {}["key"], lambda: None + 1, lambda: [][1]])
def test_other_exceptions_pass_untouched(raise_it):
    """A ValueError not from shlex, a KeyError not from optuna's storage: bugs, with their tracebacks."""
    from autotune.boundary import input_errors

    with pytest.raises((ValueError, KeyError, TypeError, IndexError)):
        with input_errors():
            raise_it()


def test_a_bug_keeps_its_traceback(monkeypatch):
    """Only exceptions caused by input are mapped: a TypeError in our own code still shows where it came from."""
    def broken(a, measure_url=None):
        raise TypeError("a bug")

    monkeypatch.setattr("autotune.cli.cmd_replay", broken)
    with pytest.raises(TypeError, match="a bug"):
        main(["replay", "--url", "http://127.0.0.1:9", "--scenario", "chat", "--rate", "1"])


def test_subprocess_shows_no_traceback(tmp_path):
    """The same through the real entry point, once: what a user's shell sees."""
    p = tmp_path / "bin.jsonl"
    p.write_bytes(b"\xff\xfe\x00garbage")
    r = subprocess.run([sys.executable, "-m", "autotune", "replay", "--url", "http://127.0.0.1:9", "--workload", str(p)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
