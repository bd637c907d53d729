"""Study files: parsing, overrides, clear errors, and --dry-run's exact command lines."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.errors import ConfigError
from autotune.study.definition import load_study
from autotune.units import parse_duration

ROOT = Path(__file__).resolve().parents[1]
STUDIES = sorted((ROOT / "studies").glob("*.toml"))


@pytest.mark.parametrize("path", STUDIES, ids=[p.stem for p in STUDIES])
def test_shipped_studies_load(path):
    d = load_study(path)
    assert d.slos and d.budget.trials
    assert d.storage.startswith(("sqlite:///", "postgresql"))


def test_shipped_examples_cover_the_seed_scenarios():
    scenarios = {(load_study(p).workload.scenario, load_study(p).platform) for p in STUDIES}
    for s in ("chat", "long-docs", "high-concurrency"):
        assert (s, "cuda") in scenarios, f"no GPU example for {s}"
    assert any(platform == "cpu" for _, platform in scenarios)


def write(tmp_path, text):
    p = tmp_path / "s.toml"
    p.write_text(text)
    return p


BASE = """
slos = ["ttft<800ms"]
[engine]
model = "m"
[workload]
scenario = "chat"
rate = 2
"""


def test_overrides(tmp_path):
    d = load_study(write(tmp_path, BASE)).with_overrides(slos=["p99:ttft<1s"], trials=7, timeout="2h",
                                                        storage="sqlite:////tmp/x.db", name="other")
    assert [s.text for s in d.slos] == ["p99:ttft<1s"]
    assert (d.budget.trials, d.budget.timeout_s, d.storage, d.name) == (7, 7200.0, "sqlite:////tmp/x.db", "other")


@pytest.mark.parametrize("extra,needle", [
    ("colour = 1\n", "unknown key(s) colour"),
    ("[budget]\ntrials = 'many'\n", "must be a int"),
    ("[objective]\nkind = 'fastest'\n", "must be 'capacity' or 'pareto'"),
    ("[space]\nmax_num_seqs = { type = 'int', low = 8, high = 4, default = 8 }\n", "needs low <= high"),
    ("[space]\nmax_num_seqs = { type = 'int', low = 8, high = 64 }\n", "default is missing"),
    ("[space]\nmax_num_seqs = { type = 'int', low = 8, high = 64, default = 8, logg = true }\n", "unknown key(s) logg"),
])
def test_errors_name_the_key(tmp_path, extra, needle):
    text = BASE + extra if extra.startswith("[") else extra + BASE
    with pytest.raises(ConfigError) as e:
        load_study(write(tmp_path, text))
    assert needle in str(e.value)


def test_capacity_needs_an_slo(tmp_path):
    with pytest.raises(ConfigError, match="needs at least one SLO"):
        load_study(write(tmp_path, BASE.replace('slos = ["ttft<800ms"]', "")))


def test_durations():
    assert parse_duration("90s", "x") == 90 and parse_duration("30m", "x") == 1800 and parse_duration(5, "x") == 5
    with pytest.raises(ConfigError, match="not a duration"):
        parse_duration("soon", "x")


def test_dry_run_prints_exact_command_lines(tmp_path):
    study = ROOT / "studies" / "tiny-cpu-chat.toml"
    r = subprocess.run([sys.executable, "-m", "autotune", "study", str(study), "--dry-run", "6", "--storage",
                        f"sqlite:///{tmp_path}/never.db"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(lines) == 6
    assert [x.get("baseline") for x in lines[:4]] == ["vllm-defaults", "xinference-4.1", "xinference-legacy",
                                                       "max-num-seqs-8"]
    for x in lines:
        argv = x["argv"]
        assert argv[1:3] == ["serve", "models/tiny-llama"] and "--port" in argv
        assert x["env"]["VLLM_CPU_KVCACHE_SPACE"] in ("1", "2")
        mnbt = int(argv[argv.index("--max-num-batched-tokens") + 1])
        assert mnbt >= int(argv[argv.index("--max-num-seqs") + 1])
    assert not (tmp_path / "never.db").exists()  # nothing stored, nothing launched
