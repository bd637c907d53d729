"""Study files: parsing, overrides, clear errors, and --dry-run's exact command lines."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.errors import ConfigError
from autotune.study.definition import load_study
from autotune.units import parse_duration
from tests.conftest import example_study

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
    ("[budget]\ntrials = 'many'\n", "[budget].trials must be an integer >= 1, got \"many\""),
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


def test_dry_run_prints_exact_command_lines(tmp_path, tiny_model):
    study = example_study("tiny-cpu-chat", tiny_model, tmp_path)
    r = subprocess.run([sys.executable, "-m", "autotune", "study", str(study), "--dry-run", "6", "--storage",
                        f"sqlite:///{tmp_path}/never.db"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(lines) == 6
    assert [x.get("baseline") for x in lines[:3]] == ["vllm-defaults", "max-num-seqs-8", None]
    for x in lines:
        argv = x["argv"]
        assert argv[1:3] == ["serve", str(tiny_model)] and "--port" in argv
        assert x["env"]["VLLM_CPU_KVCACHE_SPACE"] in ("1", "2")
        mnbt = int(argv[argv.index("--max-num-batched-tokens") + 1])
        assert mnbt >= int(argv[argv.index("--max-num-seqs") + 1])
    assert not (tmp_path / "never.db").exists()  # nothing stored, nothing launched



# --- every value read strictly: one line naming the file, the key and what it must be --------------

HEAD = 'slos = ["ttft<800ms"]\n'


def study(head=HEAD, engine="", workload="", tail=""):
    return f'{head}[engine]\nmodel = "m"\n{engine}[workload]\nscenario = "chat"\nrate = 2\n{workload}{tail}'


@pytest.mark.parametrize("text,message", [
    (study(head="slos = [800]\n"), "s.toml slos must be a list of strings, got [800]"),
    (study(head=HEAD + 'seed = "one"\n'), 's.toml seed must be an integer, got "one"'),
    (study(head=HEAD + "runs_dir = 5\n"), "s.toml runs_dir must be a string, got 5"),
    (study(head=HEAD + 'precheck = "no"\n'), 's.toml precheck must be true or false, got "no"'),
    (study(head=HEAD + "heartbeat = true\n"), "s.toml heartbeat must be a duration like 90s, 30m or 2h, got true"),
    (study(engine="port = true\n"), "s.toml [engine].port must be an integer from 1 to 65535, got true"),
    (study(engine="port = 70000\n"), "s.toml [engine].port must be an integer from 1 to 65535, got 70000"),
    (study(engine='allow_trust_remote_code = "false"\n'),
     's.toml [engine].allow_trust_remote_code must be true or false, got "false"'),
    (study(engine="command = \"vllm 'serve\"\n"),
     "s.toml [engine].command must split like a shell line, got \"vllm 'serve\" (no closing quotation)"),
    (study(engine="startup_timeout = \"0s\"\n"), 's.toml [engine].startup_timeout must be a duration > 0s, got "0s"'),
    (study(engine="env = { HF_HOME = true }\n"), "s.toml [engine.env].HF_HOME must be a string or a number, got true"),
    (study(engine='[engine.gpu]\nname = "A10"\nmemory = true\n'),
     's.toml [engine.gpu].memory must be a size like "80GiB" or a number of bytes, got true'),
    (study(workload="burstiness = 0\n"), "s.toml [workload].burstiness must be a number > 0, got 0"),
    (study(workload="rate = -1\n").replace("rate = 2\n", ""), "s.toml [workload].rate must be a number > 0, got -1"),
    (study(workload="prompt_tokens = [64, 8]\n"),
     "s.toml [workload].prompt_tokens must be N or [low, high] with 0 <= low <= high, got [64, 8]"),
    (study(tail="[budget]\ntrials = 0\n"), "s.toml [budget].trials must be an integer >= 1, got 0"),
    (study(tail="[budget]\ntrials = -3\n"), "s.toml [budget].trials must be an integer >= 1, got -3"),
    (study(tail="[objective]\nmax_steps = 0\n"), "s.toml [objective].max_steps must be an integer >= 1, got 0"),
    (study(tail="[space]\n"), "s.toml [space] is empty, so it would search nothing: name a parameter, "
                               "or leave [space] out to search the engine's default space"),
    (study(tail='[space]\nmax_num_seqs = { type = "int", low = "8", high = 64, default = 8 }\n'),
     's.toml [space].max_num_seqs.low must be an integer, got "8"'),
    (study(tail='[space]\nx = { type = "float", low = 0.1, high = 0.9, step = 0, default = 0.5 }\n'),
     "s.toml [space].x.step must be a number > 0, got 0"),
    (study(tail='[space]\ngpu_memory_utilization = { type = "float", low = 0.8, high = 1.2, default = 0.9 }\n'),
     "s.toml [space].gpu_memory_utilization.high must be a fraction of the GPU's memory, > 0 and <= 1, got 1.2"),
    (study(tail='[space]\ngpu_memory_utilization = { type = "float", low = 0, high = 0.9, default = 0.9 }\n'),
     "s.toml [space].gpu_memory_utilization.low must be a fraction of the GPU's memory, > 0 and <= 1, got 0"),
    (study(engine="[engine.args]\ngpu_memory_utilization = 1.5\n"),
     "s.toml [engine.args].gpu_memory_utilization must be a fraction of the GPU's memory, > 0 and <= 1, got 1.5"),
    (study(tail='[baselines]\nproduction = { max_num_seqs = "lots" }\n'),
     's.toml [baselines].production.max_num_seqs must be a number, got "lots"'),
    (study(tail='[baselines]\nextra = [{ name = "x", values = { enable_prefix_caching = "no" } }]\n'),
     's.toml [baselines].extra[0].values.enable_prefix_caching must be true or false, got "no"'),
    (study(tail="[baselines]\nproduction = { gpu_memory_utilization = 2 }\n"),
     "s.toml [baselines].production.gpu_memory_utilization must be a fraction of the GPU's memory, > 0 and <= 1, got 2"),
    (study(tail='[baselines]\nbuiltin = ["vllm-default"]\n'),
     "s.toml [baselines].builtin must name vLLM's built-in baselines (vllm-defaults, xinference-4.1, "
     'xinference-legacy), got ["vllm-default"]'),
], ids=lambda v: "study" if "\n" in v else v.split(" must ")[0].split(" is ")[0])
def test_each_bad_value_is_one_line_naming_the_file_and_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError) as e:
        load_study(write(tmp_path, text))
    assert type(e.value) is ConfigError
    assert str(e.value) == message


def test_a_bad_slo_names_the_file(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_study(write(tmp_path, study(head='slos = ["ttft<soon"]\n')))
    assert str(e.value).startswith("s.toml slos: ") and "\n" not in str(e.value)


def test_a_file_that_is_not_utf8_or_not_toml_is_named(tmp_path):
    p = tmp_path / "s.toml"
    p.write_bytes(study(head='name = "caf\xe9"\n' + HEAD).encode("latin-1"))
    with pytest.raises(ConfigError) as e:
        load_study(p)
    assert type(e.value) is ConfigError and str(e.value).startswith(f"{p}: not UTF-8 text")
    p.write_text("slos = [\n")
    with pytest.raises(ConfigError, match="s.toml: not valid TOML"):
        load_study(p)


def test_builtin_baselines_are_checked_against_the_engine_kind(tmp_path):
    d = load_study(write(tmp_path, study(tail='[baselines]\nbuiltin = ["xinference-4.1"]\n')))
    assert d.builtin_baselines == ("xinference-4.1",)
    sim = study(engine='kind = "vllm-sim"\n', tail='[baselines]\nbuiltin = []\n')
    assert load_study(write(tmp_path, sim)).builtin_baselines == ()


def test_a_bad_study_file_exits_2_with_one_line(tmp_path):
    p = write(tmp_path, study(engine="port = true\n"))
    r = subprocess.run([sys.executable, "-m", "autotune", "study", str(p), "--dry-run", "1"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["autotune: s.toml [engine].port must be an integer from 1 to 65535, got true"]
