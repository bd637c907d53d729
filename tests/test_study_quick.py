"""`autotune study --model M --slo ...` without a file, `autotune init`, and what a study shows while it runs.

The file-free study runs for real against vllm-sim (a simulated H100, so the default CUDA space
applies): it writes runs/<name>/study.toml, and that file reruns the same study. It tunes for a recorded
trace of short chats (``--workload``, as after ``autotune capture``): vllm-sim serves in real time, and
16-token answers keep each load step near a second where the synthetic chat's 100-400 take ten. The console is
checked three ways: plain lines (a pipe, as under journald), JSON lines (--json), and a real
terminal (a pty, where the live footer draws).
"""

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from autotune.study.definition import load_study
from tests.conftest import free_port

SIM = f"{sys.executable} -m autotune.sim.cli --gpu h100-80gb --time-scale 0.01 serve"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # a shape vllm-sim knows; prompts are built with the tiny tokenizer


def request(tiny_model, port, *more):
    """The synthetic chat at 4 requests/s: what `autotune init` writes and the one-line errors read."""
    return ["--model", MODEL, "--engine-cmd", SIM, "--tokenizer", str(tiny_model), "--slo", "ttft<800ms",
            "--slo", "tpot<60ms", "--rate", "4", "--requests", "8", "--port", str(port), *more]


def traced(tiny_model, cwd, port, *more):
    """A file-free study of a recorded trace in ``cwd``: eight short chats at 4 requests/s."""
    trace = Path(cwd) / "chat.jsonl"
    if not trace.exists():
        trace.write_text("".join(json.dumps({"arrival_s": i / 4, "prompt_tokens": 64 + 8 * i, "output_tokens": 16,
                                             "api": "chat"}) + "\n" for i in range(8)))
    return ["--model", MODEL, "--engine-cmd", SIM, "--tokenizer", str(tiny_model), "--slo", "ttft<800ms",
            "--slo", "tpot<60ms", "--workload", str(trace), "--port", str(port), *more]


def autotune(cwd, *args, timeout=300):
    env = {**os.environ, "AUTOTUNE_STATE_DIR": str(Path(cwd) / "state"), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "autotune", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


# -- init and the one-line errors ---------------------------------------------------------------------


def test_init_writes_an_annotated_study_that_loads(tmp_path, tiny_model):
    r = autotune(tmp_path, "init", *request(tiny_model, 8123, "--trials", "7"))
    assert r.returncode == 0, r.stderr
    # where the README says, and where `autotune study` with the same flags finds it and resumes
    written = "runs/Llama-3.1-8B-Instruct-chat/study.toml"
    path = tmp_path / written
    assert r.stdout.strip() == f"wrote {written}; run it with: autotune study {written}"
    assert path.read_text().startswith(f"# autotune study Llama-3.1-8B-Instruct-chat. Run (or resume) it:  "
                                       f"autotune study {path.resolve()}\n")  # the file it names is itself
    d = load_study(path)
    assert d.name == "Llama-3.1-8B-Instruct-chat" and [s.text for s in d.slos] == ["p95:ttft<800ms", "p95:tpot<60ms"]
    assert d.platform == "cuda" and d.gpus[0].name == "NVIDIA H100 80GB HBM3"  # from vllm-sim's --gpu
    assert d.budget.trials == 7 and d.workload.scenario == "chat" and d.workload.rate == 4
    assert d.workload.tokenizer == tiny_model.resolve() and d.fixed.values["tokenizer"] == str(tiny_model.resolve())
    assert d.params is None  # the default space, written out only as comments
    text = path.read_text()
    assert "# max_num_seqs = { type = \"int\"" in text and "# [space]" in text
    assert "# production = {" in text and "# timeout = " in text  # what a person may add, shown where it goes

    again = autotune(tmp_path, "init", *request(tiny_model, 8123))
    assert again.returncode == 2 and "exists: give another --out, or --force" in again.stderr


def test_the_next_command_it_prints_runs_as_typed_where_autotune_is_not_on_the_path(tmp_path, tiny_model):
    """After the quickstart, `autotune` is .venv/bin/autotune, not on the PATH: the command a run prints next names
    the program as it was run, so it runs as typed (issue 55); on the PATH, it is plain `autotune`."""
    program = Path(sys.executable).parent / "autotune"
    env = {**os.environ, "PATH": "/usr/bin:/bin", "AUTOTUNE_STATE_DIR": str(tmp_path / "state")}
    r = subprocess.run([str(program), "init", *request(tiny_model, 8123), "--out", "s.toml"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"wrote s.toml; run it with: {program} study s.toml"
    on_path = subprocess.run([str(program), "init", *request(tiny_model, 8123), "--out", "t.toml"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120,
                             env={**env, "PATH": f"{program.parent}:/usr/bin:/bin"})
    assert on_path.stdout.strip() == "wrote t.toml; run it with: autotune study t.toml", on_path.stderr


def test_without_a_gpu_init_says_it_tunes_the_cpu_backend_and_how_to_name_a_gpu(tmp_path, tiny_model):
    """This host has no NVIDIA GPU: with real vLLM (not the sim) the study is a CPU study, and it says so."""
    r = autotune(tmp_path, "init", "--model", str(tiny_model), "--slo", "ttft<1s", "--rate", "2", "--out", "s.toml")
    assert r.returncode == 0, r.stderr
    assert "no NVIDIA GPU is visible to NVML" in r.stderr and "add [engine.gpu]" in r.stderr
    d = load_study(tmp_path / "s.toml")
    assert d.platform == "cpu" and d.gpus is None and d.command.nice == 10
    assert d.workload.tokenizer == tiny_model.resolve()  # the model's own directory


@pytest.mark.parametrize("args,needle", [
    (["--model", "no/such-model", "--slo", "ttft<1s", "--rate", "2"],
     "not a local directory, and not in the Hugging Face cache"),
    # a path that is not there: no download can help, and the line does not offer one (issue 55)
    (["--model", "/nonexistent/model-dir", "--slo", "ttft<1s", "--rate", "2"],
     "no such directory (and not a Hugging Face id: org/name): give --model the directory the model was downloaded to"),
    (["--model", "{tiny}", "--rate", "2"], "give the latency promise to tune for: --slo"),
    (["--model", "{tiny}", "--slo", "ttft<1s"], "say what traffic to tune for: --workload"),
    (["--model", "{tiny}", "--slo", "ttft<<1s", "--rate", "2"], "ttft<<1s"),
    (["--slo", "ttft<1s", "--rate", "2"], "give a study file, or the model to tune: --model"),
    (["studies/tiny-cpu-chat.toml", "--model", "{tiny}"], "give a study file or --model and its flags, not both"),
])
def test_a_missing_piece_is_one_line_saying_what_to_add(tmp_path, tiny_model, args, needle):
    args = [a.replace("{tiny}", str(tiny_model)) for a in args]
    if args[0].endswith(".toml"):
        args[0] = str(Path(__file__).resolve().parents[1] / args[0])
    r = autotune(tmp_path, "study", *args)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "runs").exists()  # nothing written for a request that cannot run


def test_the_file_free_path_parses_the_slos_it_is_given_once_and_the_file_it_writes_once(
        tmp_path, tiny_model, monkeypatch, capsys):
    """The flags' SLOs become SLOs once (their typos are one-line errors), and the study file written from them is
    read once: no re-parse of the same strings on the way (counted at the one regex every SLO string meets)."""
    from autotune.cli import main
    from autotune.measure import slo

    class Counting:
        def __init__(self, pattern):
            self.pattern, self.texts = pattern, []

        def match(self, text):
            self.texts.append(text)
            return self.pattern.match(text)

    counted = Counting(slo._SLO_RE)
    monkeypatch.setattr(slo, "_SLO_RE", counted)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AUTOTUNE_STATE_DIR", str(tmp_path / "state"))
    assert main(["study", *request(tiny_model, free_port()), "--dry-run", "1"]) == 0
    # the dry run says what the real study decides here: vllm-sim models its simulated H100 (issue 55)
    assert "the real study simulates first with vllm-sim's h100-80gb profile" in capsys.readouterr().err
    # the flags ("ttft<800ms", "tpot<60ms") once, then the file's normalized texts once
    assert counted.texts == ["ttft<800ms", "tpot<60ms", "p95:ttft<800ms", "p95:tpot<60ms"], counted.texts


# -- the file-free study, end to end ------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, tiny_model):
    """A three-trial file-free study, its output piped (as under journald)."""
    cwd = tmp_path_factory.mktemp("plain")
    port = free_port()
    r = autotune(cwd, "study", *traced(tiny_model, cwd, port, "--trials", "3", "--no-remeasure"))
    return cwd, port, r


def test_the_file_free_study_runs_and_writes_its_file(plain_run):
    cwd, _, r = plain_run
    assert r.returncode == 0, r.stderr[-3000:]
    name = "Llama-3.1-8B-Instruct-chat"
    path = Path("runs") / name / "study.toml"
    assert f"autotune: wrote {path}; edit it, or rerun and resume with: autotune study {path}" in r.stderr
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{cwd}/runs/studies.db")
    assert len(study.trials) == 3
    assert study.trials[0].user_attrs["baseline"] == "vllm-defaults"
    assert (cwd / "runs" / name / "best.yaml").is_file()
    assert f"autotune report {path}" in r.stdout


def test_plain_output_is_one_line_per_trial_in_our_words_and_no_optuna_lines(plain_run):
    cwd, _, r = plain_run
    trial_lines = [line for line in r.stderr.splitlines() if re.match(r"\d\d:\d\d:\d\d trial \d+ \(", line)]
    assert len(trial_lines) == 3, r.stderr[-3000:]
    assert "trial 0 (baseline vllm-defaults) " in trial_lines[0] and " req/s within the SLOs (" in trial_lines[0]
    progress = [line for line in r.stderr.splitlines() if re.search(r"\d\d:\d\d:\d\d \d/3 trials; best ", line)]
    assert [p.split()[1] for p in progress] == ["1/3", "2/3", "3/3"]
    assert "GPU time" in progress[-1] and "left" in progress[0]
    assert "[I 20" not in r.stderr and "[W 20" not in r.stderr  # Optuna's own lines are not on the console
    log = (cwd / "runs" / "Llama-3.1-8B-Instruct-chat" / "study.log").read_text()
    assert "Trial 2 finished" in log and "trial 2 (" in log  # Optuna's lines and ours, in the study's log


def test_the_written_file_reruns_the_same_study(plain_run, tiny_model):
    cwd, port, first = plain_run
    path = "runs/Llama-3.1-8B-Instruct-chat/study.toml"
    r = autotune(cwd, "study", path, "--no-remeasure")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "budget of 3 trials already spent" in r.stderr
    best = json.loads((cwd / "runs" / "Llama-3.1-8B-Instruct-chat" / "best.json").read_text())
    assert f"best config of trial {best['trial']}," in (cwd / "runs/Llama-3.1-8B-Instruct-chat/best.yaml").read_text()
    # the same flags again find the same study and resume it; the file's dry run is the flags' dry run
    again = autotune(cwd, "study", *traced(tiny_model, cwd, port, "--trials", "3", "--dry-run", "2"))
    from_file = autotune(cwd, "study", path, "--dry-run", "2")
    assert again.returncode == 0 and from_file.returncode == 0, again.stderr + from_file.stderr
    assert "autotune: resuming" in again.stderr
    assert again.stdout == from_file.stdout and again.stdout.count("\n") == 2
    # other flags under the same name: one line, nothing overwritten
    other = autotune(cwd, "study", *traced(tiny_model, cwd, port, "--trials", "5"))
    assert other.returncode == 2 and "holds another study named" in other.stderr, other.stderr


def test_json_lines_are_the_only_stdout(tmp_path, tiny_model):
    r = autotune(tmp_path, "study",
                 *traced(tiny_model, tmp_path, free_port(), "--trials", "2", "--no-remeasure", "--json"))
    assert r.returncode == 0, r.stderr[-3000:]
    events = [json.loads(line) for line in r.stdout.splitlines()]  # every line parses
    assert [e["event"] for e in events] == ["trial", "trial", "result"]
    first = events[0]
    assert first["label"] == "vllm-defaults" and first["chosen_because"] == "baseline vllm-defaults"
    assert first["capacity_rps"] > 0 and first["feasible"] is True and first["wall_s"] > 0
    result = events[-1]
    assert result["winner"]["capacity_rps"] == max(e["capacity_rps"] for e in events[:-1] if e["feasible"])
    assert result["files"]["config"].endswith("best.yaml")


def test_a_terminal_gets_the_live_footer(tmp_path, tiny_model):
    """A pty: rich draws the footer (phase, trials done, best so far, GPU time) and trial lines above it."""
    master, slave = pty.openpty()
    env = {**os.environ, "AUTOTUNE_STATE_DIR": str(tmp_path / "state"), "TERM": "xterm", "COLUMNS": "200"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen([sys.executable, "-m", "autotune", "study",
                             *traced(tiny_model, tmp_path, free_port(), "--trials", "2", "--no-remeasure")],
                            cwd=tmp_path, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the child closed the pty
                    break
                if not chunk:
                    break
                seen += chunk
            elif proc.poll() is not None:
                break
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
        os.close(master)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", seen.decode("utf-8", "replace"))
    assert rc == 0, text[-3000:]
    assert "autotune study Llama-3.1-8B-Instruct-chat (2 trials): " in text  # the footer's first line
    assert re.search(r"1/2 trials; best (at least )?[0-9.]+ req/s \(trial 0\); GPU time \S+, about \S+ left", text), text[-3000:]
    assert "trial 0 (baseline vllm-defaults) " in text and "trial 1 (baseline " in text
    assert "best config against the baselines" in text  # the tables come after the footer is gone
