#!/usr/bin/env python3
"""Screenshots of what a person reads first, from a real study: the HTML report and a trial's page in
optuna-dashboard (with its note), taken by headless Chromium; tests/test_screenshots.py checks the same
pages' rendered text in CI.

    .venv/bin/python scripts/screenshots.py              # docs/report.png, docs/dashboard-trial.png
    .venv/bin/python scripts/screenshots.py --out /tmp/shots --keep /tmp/shots/work

It runs a small study against vllm-sim with the CLI (about a minute: baselines, a real start-up
oom, two sampled trials, the re-measurement), writes its report with ``autotune report``, serves
the study with ``optuna-dashboard`` and shoots the winner's trial page.

Chromium is Debian's ``chromium`` (scripts/ci_system_deps.sh installs it). Every child (the
study, the dashboard, each Chromium) runs in its own process group and is killed, group and all,
when it is done or whatever goes wrong; a study stopped that way gets SIGTERM first, so it
stops its engine itself.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the study of tests/test_study_sim.py: an 8B model on a simulated A10 keeps request rates (and this host's CPU) low
STUDY = """
name = "{name}"
slos = ["ttft<500ms", "tpot<60ms"]
seed = 0
storage = "sqlite:///{runs}/studies.db"
runs_dir = "{runs}"

[engine]
command = "python -m autotune.sim.cli --gpu a10-24gb --time-scale 0.01 serve"
model = "llama-3.1-8b"
platform = "cuda"
port = {port}
startup_timeout = "60s"

[engine.gpu]
name = "NVIDIA A10"
memory = "23028MiB"

[engine.args]
max_model_len = 16384
tokenizer = "models/tiny-llama"

[space]
gpu_memory_utilization = {{ type = "categorical", choices = [0.85, 0.92], default = 0.92 }}
max_num_seqs = {{ type = "int", low = 2, high = 64, log = true, default = 64 }}

[workload]
scenario = "high-concurrency"
rate = 2
requests = 20
prompt_tokens = [32, 128]
output_tokens = [16, 32]

[objective]
kind = "capacity"
max_steps = {max_steps}
step_duration = "2s"

[budget]
trials = {trials}

[baselines]
builtin = ["vllm-defaults", "xinference-legacy"]   # legacy: 70 % of the GPU, chunked prefill off
extra = [{{ name = "max-num-seqs-2", values = {{ max_num_seqs = 2 }} }}]

[remeasure]
top = 1
repeats = 1
"""
SLOS = ["ttft<500ms", "tpot<60ms"]
REPORT_SIZE = (1400, 1100)
TRIAL_SIZE = (1400, 1300)


class ChromiumMissing(RuntimeError):
    pass


# -- children, owned ------------------------------------------------------------------------------

def _stop_group(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM the child's process group (and any descendant that left it), SIGKILL what is left after ``grace``."""
    import psutil

    try:
        kids = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
    except psutil.NoSuchProcess:
        kids = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    _, alive = psutil.wait_procs(kids, timeout=max(0.0, grace / 2))
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for k in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            k.kill()
    proc.wait()


def run_owned(argv: Sequence[str], timeout: float, grace: float = 5.0, **kw) -> subprocess.CompletedProcess:
    """``subprocess.run`` whose child leads its own process group, stopped group and all on a timeout or an error."""
    proc = subprocess.Popen(list(argv), start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        _stop_group(proc, grace)  # a leader that exited may leave its group behind (Chromium's helpers)
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- Chromium -------------------------------------------------------------------------------------

def chromium() -> str:
    exe = shutil.which("chromium")
    if exe is None:
        raise ChromiumMissing("chromium is not installed: run scripts/ci_system_deps.sh (Debian package chromium)")
    return exe


def _target(url_or_file: str | Path) -> str:
    s = str(url_or_file)
    return s if "://" in s else Path(s).resolve().as_uri()


def _chromium(args: list[str], url_or_file: str | Path, wait_s: float,
              workdir: Path | None) -> subprocess.CompletedProcess:
    # a fresh profile and home under ``workdir`` (default: the system's temp): Chromium writes its crash-report
    # settings under $HOME. Its TMPDIR (a singleton socket: a path of at most 107 bytes, which pytest's tmp
    # paths exceed) is a private directory in the system's temp, removed with everything in it.
    with tempfile.TemporaryDirectory(prefix="chromium-", dir=workdir) as tmp, \
            tempfile.TemporaryDirectory(prefix="chr") as scratch:
        home = Path(tmp, "home")
        home.mkdir()
        env = {**os.environ, "HOME": str(home), "TMPDIR": scratch, "XDG_CONFIG_HOME": str(home / ".config"),
               "XDG_CACHE_HOME": str(home / ".cache")}
        argv = [chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--hide-scrollbars", f"--user-data-dir={Path(tmp, 'profile')}",
                # virtual time: the page's scripts and fetches run until idle or the budget, whichever first
                f"--virtual-time-budget={int(wait_s * 1000)}", *args, _target(url_or_file)]
        r = run_owned(argv, timeout=wait_s + 90, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"chromium exited {r.returncode}: {r.stderr[-2000:]}")
    return r


def dom(url_or_file: str | Path, wait_s: float = 10.0, workdir: Path | None = None) -> str:
    """The page's DOM after its scripts ran (the dashboard is a React app: the HTML it serves is empty)."""
    return _chromium(["--dump-dom"], url_or_file, wait_s, workdir).stdout


def screenshot(url_or_file: str | Path, png: Path, size: tuple[int, int] = (1400, 1000), wait_s: float = 10.0,
               workdir: Path | None = None) -> Path:
    """A PNG of the page's top ``size`` pixels."""
    png = Path(png).resolve()
    png.parent.mkdir(parents=True, exist_ok=True)
    png.unlink(missing_ok=True)
    _chromium([f"--window-size={size[0]},{size[1]}", f"--screenshot={png}"], url_or_file, wait_s, workdir)
    if not png.is_file():
        raise RuntimeError(f"chromium wrote no {png}")
    return png


# -- optuna-dashboard -----------------------------------------------------------------------------

@contextlib.contextmanager
def dashboard(storage: str, log: Path, artifact_dir: Path | None = None, timeout: float = 60.0) -> Iterator[str]:
    """optuna-dashboard serving ``storage`` on a free port, its own process group; yields its base URL."""
    exe = shutil.which("optuna-dashboard") or str(Path(sys.executable).parent / "optuna-dashboard")
    port = free_port()
    argv = [exe, storage, "--host", "127.0.0.1", "--port", str(port)]
    if artifact_dir is not None:
        argv += ["--artifact-dir", str(artifact_dir)]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"optuna-dashboard exited {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(base + "/api/meta", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"optuna-dashboard did not serve {base} within {timeout:.0f} s")
            time.sleep(0.2)
        yield base
    finally:
        _stop_group(proc, 5.0)


def trial_url(base: str, study_id: int, number: int) -> str:
    """A trial's page: the dashboard's trial list with that trial selected (its note on top)."""
    return f"{base}/dashboard/studies/{study_id}/trials?numbers={number}"


# -- the study ------------------------------------------------------------------------------------

@dataclass
class SimStudy:
    file: Path
    name: str
    storage: str
    run_dir: Path
    run: subprocess.CompletedProcess


def sim_study(workdir: Path, tiny_model: Path, trials: int = 5, max_steps: int = 3,
              name: str = "sim-screenshots") -> SimStudy:
    """A small real study against vllm-sim, made with the CLI: about a minute with 3 load steps a trial, where
    every config that meets the SLOs tops out at the same load; 6 steps (a minute and a half) tell them apart.
    It runs in ``workdir`` with the model at models/tiny-llama there and the engine's ``python`` found on the PATH,
    so what the pages show (argv, best.yaml) holds no path of this machine."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "models").mkdir(exist_ok=True)
    with contextlib.suppress(FileExistsError):
        (workdir / "models" / "tiny-llama").symlink_to(tiny_model.resolve(), target_is_directory=True)
    file = workdir / f"{name}.toml"
    file.write_text(STUDY.format(name=name, runs=workdir, port=free_port(), trials=trials, max_steps=max_steps))
    env = _env(workdir)
    r = run_owned([sys.executable, "-m", "autotune", "study", str(file)], timeout=400, grace=30.0, cwd=workdir, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"autotune study exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    storage = f"sqlite:///{workdir}/studies.db"  # the runner wrote the notes, after each trial and at the end
    return SimStudy(file, name, storage, workdir / name, r)


def _env(workdir: Path) -> dict[str, str]:
    """The study's environment: its own state directory, and this interpreter's ``python`` first on the PATH."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "AUTOTUNE_STATE_DIR": str(workdir / "state"), "PATH": path}


def write_report(s: SimStudy, out: Path) -> Path:
    r = run_owned([sys.executable, "-m", "autotune", "report", str(s.file), "--out", str(out)], timeout=120,
                  cwd=s.file.parent, env=_env(s.file.parent))
    if r.returncode != 0:
        raise RuntimeError(f"autotune report exited {r.returncode}:\n{r.stderr[-3000:]}")
    return out


def shown_trial(s: SimStudy) -> tuple[int, int]:
    """The study's id in its storage and the trial to show: the winner, else the best baseline, else trial 0."""
    import optuna

    from autotune.study.records import StudyResult

    study = optuna.load_study(study_name=s.name, storage=s.storage)
    result = StudyResult.of(study)
    pick = result.winner or result.best_baseline
    return study._study_id, pick.number if pick else 0


def tiny_model() -> Path:
    path = Path(os.environ.get("AUTOTUNE_TINY_MODEL", ROOT / "models" / "tiny-llama"))
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_tiny_model.py"), str(path)], check=True,
                   stdout=subprocess.DEVNULL)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "docs", help="where the PNGs go (default: docs/)")
    ap.add_argument("--keep", type=Path, help="make the study here and keep it (default: a temporary directory)")
    a = ap.parse_args(argv)
    chromium()  # missing: say so before a minute of study
    with contextlib.ExitStack() as stack:
        work = a.keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="screenshots-")))
        t0 = time.monotonic()
        s = sim_study(work, tiny_model(), max_steps=6)
        print(f"study: {time.monotonic() - t0:.0f} s, {s.storage}", file=sys.stderr)
        report = write_report(s, work / "report.html")
        print(screenshot(report, a.out / "report.png", REPORT_SIZE))
        study_id, number = shown_trial(s)
        with dashboard(s.storage, work / "dashboard.log", s.run_dir / "artifacts") as base:
            print(screenshot(trial_url(base, study_id, number), a.out / "dashboard-trial.png", TRIAL_SIZE))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
