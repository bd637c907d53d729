"""``autotune report`` answers first: studies built in SQLite without an engine, trials shaped as the runner
writes them (steps from the real Step/Summary types), the page read back as text."""

import json
import re
import shlex

import optuna
import pytest
from optuna.distributions import IntDistribution
from optuna.trial import TrialState, create_trial

from autotune.engine.args import EngineArgs
from autotune.measure.metrics import RequestResult, summarize
from autotune.measure.session import Step
from autotune.measure.slo import parse_slos
from autotune.study.definition import load_study
from autotune.study.outputs import write_verdict
from autotune.study.records import NO_MEASUREMENT, Attr, Candidate, RaceRecord, StudyResult, judge
from autotune.study.report import MIN_IMPORTANCE_TRIALS, write_report

SLOS = parse_slos(["ttft<300ms", "tpot<50ms"])
DIST = {"max_num_seqs": IntDistribution(8, 256, log=True)}
HOSTILE = "<script>alert(1)</script>"


def study_toml(tmp_path, objective="capacity"):
    path = tmp_path / "rep.toml"
    path.write_text(f"""
name = "rep"
slos = ["ttft<300ms", "tpot<50ms"]
storage = "sqlite:///{tmp_path}/s.db"
runs_dir = "{tmp_path}/runs"

[engine]
command = "vllm serve"
model = "no/such-model"
platform = "cpu"

[space]
max_num_seqs = {{ type = "int", low = 8, high = 256, log = true, default = 128 }}

[workload]
scenario = "chat"
rate = 8
requests = 64

[objective]
kind = "{objective}"
""")
    return load_study(path)


def step(rate, ttft, tpot, n=20):
    """One load step as Step.to_json() writes it: n requests of 10 output tokens, sent on schedule."""
    results = [RequestResult(i, i / rate, i / rate, True, ttft=ttft, itl=[tpot] * 9, e2e=ttft + 9 * tpot,
                             prompt_tokens=100, output_tokens=10, expected_output_tokens=10, elapsed=ttft + 9 * tpot)
               for i in range(n)]
    summary = summarize(results, SLOS)
    return Step(rate / 8, rate, summary, summary.verdicts(SLOS), n / rate, results).to_json()


def base_attrs(seqs, baseline=None):
    values, env = {"max_num_seqs": seqs, "max_model_len": 4096}, {"HF_TOKEN": "<redacted>"}
    attrs = {Attr.ARGV: ["vllm", "serve", "no/such-model", "--max-num-seqs", str(seqs), "--max-model-len", "4096"],
             Attr.ENV: env, Attr.ENGINE_ARGS: {"values": values, "env": env},
             Attr.HOST: "h", Attr.WORKER: "h:1", Attr.GPUS: [], Attr.TRIAL_WALL_S: 60.0}
    if baseline:
        attrs[Attr.BASELINE] = baseline
    return attrs


def measured(seqs, ladder, baseline=None, predicted=None):
    """A trial that measured ``ladder``: (req/s, p95 TTFT s, p95 TPOT s) per step, as the runner records it."""
    steps = [step(*s) for s in ladder]
    passed = [s for s in steps if s["passed"]]
    judged = max(passed, key=lambda s: s["load"]) if passed else min(steps, key=lambda s: s["load"])
    cap = judged["rate"] if passed else 0.0
    attrs = {**base_attrs(seqs, baseline), Attr.STEPS: steps, Attr.CAPACITY_RPS: cap,
             Attr.CONSTRAINTS: [v["violation"] for v in judged["slos"]],
             Attr.CAPACITY_OUTPUT_TOK_S: judged["output_throughput"] if passed else 0.0}
    if predicted is not None:
        attrs[Attr.PREDICTED_CAPACITY_RPS] = predicted
    return create_trial(params={"max_num_seqs": seqs}, distributions=DIST, value=cap, state=TrialState.COMPLETE,
                        user_attrs=attrs)


def failed(seqs, cls, line, precheck=None, baseline=None):
    attrs = {**base_attrs(seqs, baseline), Attr.FAILURE_CLASS: cls, Attr.FAILURE: line,
             Attr.FAILURE_EXCERPT: "...\n" + line, Attr.FAILURE_ENGINE_SECONDS: 0.0 if precheck else 12.0,
             Attr.CONSTRAINTS: [NO_MEASUREMENT] * 2, Attr.CAPACITY_RPS: 0.0}
    if precheck:
        attrs[Attr.PRECHECK] = precheck
    return create_trial(params={"max_num_seqs": seqs}, distributions=DIST, state=TrialState.PRUNED, user_attrs=attrs)


def build(d, trials, runs=None):
    """The study ``d`` names, holding ``trials``; ``runs``: (trial number, capacities) per re-measured candidate,
    the best baseline last."""
    study = optuna.create_study(study_name=d.name, storage=d.storage, directions=["maximize"])
    for t in trials:
        study.add_trial(t)
    if runs is not None:
        cands = [Candidate(f"baseline {study.trials[n].user_attrs[Attr.BASELINE]}" if i == len(runs) - 1
                           else f"trial {n}", n, EngineArgs({}), caps) for i, (n, caps) in enumerate(runs)]
        study.set_user_attr(Attr.REMEASURE, judge(cands, trials_seen=len(study.trials)).to_json())
    return study


GOOD = [(2.0, 0.10, 0.02), (2.8, 0.15, 0.03), (3.2, 0.25, 0.04), (4.0, 0.50, 0.07)]  # capacity 3.2
BASE = [(1.6, 0.10, 0.02), (2.21, 0.20, 0.04), (3.0, 0.40, 0.06)]  # capacity 2.21


def typical(with_hostile=False):
    return [measured(128, BASE, baseline="vllm-defaults"),
            failed(256, "oom", "pre-check: the KV cache needs 9.1 GiB, the device has 8", precheck="too big",
                   baseline="xinference-4.1"),
            measured(64, GOOD),
            failed(200, "oom", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
            failed(16, "crashed", HOSTILE if with_hostile else "RuntimeError: engine core died")]


def verdict_of(page):
    section = re.search(r'<section id="verdict">(.*?)</section>', page, re.S).group(1)
    return re.sub(r"<[^>]+>", " ", section)


def first_line(page):
    return re.search(r'id="verdict-line"><strong>(.*?)</strong>', page, re.S).group(1)


def report(d, tmp_path):
    return write_report(d, tmp_path / "out" / "report.html").read_text()


def test_a_significant_gain_is_the_first_line(tmp_path):
    d = study_toml(tmp_path)
    build(d, typical(), runs=[(2, [3.2, 3.1, 3.3]), (0, [2.2, 2.21, 2.25])])
    page = report(d, tmp_path)
    line = first_line(page)
    # posterior medians: each run's capacity is known to its 1.05x step, so 3.1-3.3 puts it at ~3.26
    assert line == ("Winner: trial 2 (max_num_seqs=64): 3.26 req/s within the SLOs (posterior median, 3 re-measured runs), +44 % "
                    "over baseline vllm-defaults (2.27 req/s); re-measured, interleaved: trial 2 beats baseline "
                    "vllm-defaults by 1.00 req/s (P = 1.00 that it is better, 0.9 required): deploy trial 2.")
    text = verdict_of(page)
    assert text.lstrip().startswith("Winner: trial 2")
    # the gain over each baseline, the re-measured runs, the config file, the command line, the SLOs
    gains = re.search(r'<table id="gains">(.*?)</table>', page, re.S).group(1)
    assert "<td>vllm-defaults</td><td>0</td><td>2.21</td><td>+45 %</td>" in gains
    assert "<td>xinference-4.1</td><td>1</td><td>oom</td>" in gains
    assert "3.20, 3.10, 3.30" in text and "baseline vllm-defaults" in text
    config = re.search(r'<pre id="winner-config">(.*?)</pre>', page, re.S).group(1)
    assert "max-num-seqs: 64" in config and "model: no/such-model" in config
    assert "# autotune: best config of trial 2, capacity 3.26 req/s" in config
    command = re.search(r'<pre id="winner-command">(.*?)</pre>', page, re.S).group(1)
    assert command == ("env HF_TOKEN=&#x27;&lt;redacted&gt;&#x27; "
                       "vllm serve no/such-model --max-num-seqs 64 --max-model-len 4096")
    slos = re.search(r'<table id="winner-slos">(.*?)</table>', page, re.S).group(1)
    assert "<td>p95:ttft&lt;300ms</td><td>250 ms</td><td>300 ms</td><td>holds</td>" in slos
    assert "<td>p95:tpot&lt;50ms</td><td>40 ms</td><td>50 ms</td><td>holds</td>" in slos
    # the answer comes first, Optuna's history last
    at = [page.index(f'<section id="{s}">') for s in
          ("verdict", "ladders", "failures", "predictions", "importance", "history")]
    assert at == sorted(at)


def test_a_gain_within_the_spread_is_not_significant(tmp_path):
    d = study_toml(tmp_path)
    build(d, typical(), runs=[(2, [2.5, 2.0, 2.9]), (0, [2.2, 2.21, 2.25])])
    page = report(d, tmp_path)
    line = first_line(page)
    # the headline names what best.yaml holds: the baseline, since the leader's gain is not sure enough
    assert line == ("Winner: trial 0 (baseline vllm-defaults): 2.27 req/s within the SLOs (posterior median, 3 re-measured runs); "
                    "re-measured, interleaved: no gain: trial 2 leads baseline vllm-defaults by 0.30 req/s, not "
                    "surely (P = 0.85 that it is better, 0.9 required): keep baseline vllm-defaults.")
    config = re.search(r'<pre id="winner-config">(.*?)</pre>', page, re.S).group(1)
    assert "# autotune: best config of trial 0" in config and "max-num-seqs: 64" not in config


def test_the_files_a_user_deploys_are_the_verdict(tmp_path):
    """A leader within the noise is not what best.yaml holds: the baseline is; the leader is kept beside it,
    named for what it is, and a later verdict that stands removes it."""
    d = study_toml(tmp_path)
    study = build(d, typical(), runs=[(2, [2.5, 2.0, 2.9]), (0, [2.2, 2.21, 2.25])])
    out = tmp_path / "out"
    paths = write_verdict(StudyResult.of(study), d.command.model, d.command.engine_kind, out)
    assert "max-num-seqs: 128" in paths["config"].read_text() and "# autotune: best config of trial 0" in \
        paths["config"].read_text()
    assert json.loads((out / "best.json").read_text())["trial"] == 0
    assert "--max-num-seqs 128" in (out / "best-command.sh").read_text()
    kept = (out / "not-recommended.yaml").read_text()
    assert "max-num-seqs: 64" in kept and ("# not recommended: re-measured, no gain: trial 2 leads baseline "
                                           "vllm-defaults by 0.30 req/s, not surely (P = 0.85") in kept
    assert json.loads((out / "not-recommended.json").read_text())["trial"] == 2
    assert set(paths) == {"config", "command", "json", "docker", "not-recommended-config", "not-recommended-command",
                          "not-recommended-json", "not-recommended-docker"}

    study.set_user_attr(Attr.REMEASURE, judge([Candidate("trial 2", 2, EngineArgs({}), [3.2, 3.1, 3.3]),
                                               Candidate("baseline vllm-defaults", 0, EngineArgs({}),
                                                         [2.2, 2.21, 2.25])], trials_seen=5).to_json())
    paths = write_verdict(StudyResult.of(study), d.command.model, d.command.engine_kind, out)
    assert json.loads(paths["json"].read_text())["trial"] == 2
    assert sorted(p.name for p in out.iterdir()) == ["best-command.sh", "best-docker.sh", "best.json", "best.yaml"]


def test_the_container_line_runs_the_official_image_on_the_config(tmp_path):
    """The image's entry point is `vllm serve` (its Dockerfile: ENTRYPOINT ["vllm", "serve"]): the words after the
    image are vllm serve's own, checked against vLLM's flag table; the config, the cache and secrets get in."""
    d = study_toml(tmp_path)
    study = build(d, typical())
    paths = write_verdict(StudyResult.of(study), d.command.model, d.command.engine_kind, tmp_path / "out",
                          version="0.32.0")
    line = paths["docker"].read_text().splitlines()[-1]
    words = shlex.split(line.removeprefix("exec "))  # as sh would split it, the cache's $HOME left unexpanded
    image = words.index("vllm/vllm-openai:v0.32.0")
    assert words[:3] == ["docker", "run", "--rm"] and "--gpus" in words and "127.0.0.1:8000:8000" in words
    assert f"{paths['config'].resolve()}:/etc/vllm/config.yaml:ro" in words
    assert "${HF_HOME:-$HOME/.cache/huggingface}:/root/.cache/huggingface" in words
    assert words[words.index("HF_TOKEN") - 1] == "-e"  # the redacted token by name: docker reads the caller's
    after = words[image + 1:]
    assert after[:2] == ["--config", "/etc/vllm/config.yaml"] and "serve" not in after
    table = d.command.flag_table()  # vLLM's own parser's flags (tests/test_flags_installed.py keeps them true)
    flags = after[0::2]
    assert flags == ["--config", "--host", "--port"] and all(table.lookup(f) is not None for f in flags)


def test_a_study_on_vllms_cpu_build_gets_its_cpu_image_and_a_local_model_where_the_container_sees_it(
        tmp_path, monkeypatch):
    """The container line fits the study (issue 55): measured on vLLM's CPU build, vLLM's CPU image with no GPUs;
    a model given as a relative directory is mounted and named at its absolute path inside the container."""
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    d = study_toml(tmp_path)
    study = build(d, typical())
    monkeypatch.chdir(tmp_path)  # the model as the study named it: relative to where it ran
    paths = write_verdict(StudyResult.of(study), "./models/tiny", d.command.engine_kind, tmp_path / "out",
                          version="0.32.0+cpu")
    words = shlex.split(paths["docker"].read_text().splitlines()[-1].removeprefix("exec "))
    image = words.index("public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0")
    assert "--gpus" not in words and "vllm/vllm-openai:v0.32.0" not in words
    assert f"{model}:{model}:ro" in words
    assert words[image + 1] == str(model) and words[image + 2:image + 4] == ["--config", "/etc/vllm/config.yaml"]
    # the study's compile cache, named relative to where it ran: mounted, and named, where it resolves
    line = d.command.engine_kind.container_line("./models/tiny", paths["config"],
                                                {"VLLM_CACHE_ROOT": "runs/vllm-cache"}, "0.32.0+cpu")
    words, cache = shlex.split(line), tmp_path / "runs" / "vllm-cache"
    assert words[words.index(f"VLLM_CACHE_ROOT={cache}") - 1] == "-e"
    assert words[words.index(f"{cache}:{cache}") - 1] == "-v"


def test_a_baseline_that_wins_the_remeasurement_is_kept(tmp_path):
    d = study_toml(tmp_path)
    build(d, typical(), runs=[(2, [2.0, 2.1, 2.05]), (0, [2.2, 2.21, 2.25])])
    line = first_line(report(d, tmp_path))
    assert re.fullmatch(
        r"Winner: trial 0 \(baseline vllm-defaults\): 2\.27 req/s within the SLOs \(posterior median, 3 re-measured "
        r"runs\); re-measured, interleaved: no gain: no searched config beat baseline vllm-defaults on the posterior "
        r"median \(P = (0\.\d\d|1\.00) that it is within 95 % of the best re-measured config\); keep baseline "
        r"vllm-defaults\.", line), line
    p = float(re.search(r"P = ([\d.]+)", line).group(1))
    assert 0.5 < p <= 1.0  # the baseline re-measured above the sampled config in every run


def test_without_remeasurement_the_gain_is_unverified(tmp_path):
    d = study_toml(tmp_path)
    build(d, typical())
    line = first_line(report(d, tmp_path))
    assert line == ("Winner: trial 2 (max_num_seqs=64): 3.20 req/s within the SLOs, +45 % over vllm-defaults "
                    "(2.21 req/s); from single measurements, not re-measured: the gain is unverified.")
    assert 'id="remeasured"' not in report(d, tmp_path)


def test_a_stale_remeasurement_is_not_believed(tmp_path):
    d = study_toml(tmp_path)
    study = build(d, typical(), runs=[(2, [3.2, 3.1, 3.3]), (0, [2.2, 2.21, 2.25])])
    study.add_trial(measured(32, BASE))  # a trial after the verdict: it no longer speaks for the study
    assert "unverified" in first_line(report(d, tmp_path))


def test_no_feasible_trial_says_what_the_closest_missed(tmp_path):
    d = study_toml(tmp_path)
    build(d, [measured(128, [(2.0, 0.9, 0.02), (1.0, 0.35, 0.02)], baseline="vllm-defaults"),
              measured(64, [(2.0, 2.0, 0.09)]),
              failed(256, "oom", "CUDA out of memory")])
    page = report(d, tmp_path)
    assert first_line(page) == ("No configuration met every SLO: the closest, trial 0 (baseline vllm-defaults), missed "
                                "p95:ttft&lt;300ms (measured 350 ms) at its lowest load, 1.00 req/s.")
    assert 'id="gains"' not in page and 'id="winner-config"' not in page


def test_no_trial_that_measured_anything(tmp_path):
    d = study_toml(tmp_path)
    build(d, [failed(128, "startup-timeout", "not healthy after 900 s", baseline="vllm-defaults"),
              failed(64, "crashed", "engine core died")])
    assert first_line(report(d, tmp_path)) == ("No configuration met every SLO: no trial measured anything (2 of 2 "
                                               "failed; see the failures below).")


def test_failures_are_grouped_by_class_with_their_proving_lines(tmp_path):
    d = study_toml(tmp_path)
    build(d, typical())
    page = report(d, tmp_path)
    failures = re.search(r'<section id="failures">(.*?)</section>', page, re.S).group(1)
    groups = re.findall(r'<h3 class="failure-class">(.*?)</h3><ul>(.*?)</ul>', failures, re.S)
    assert [g[0] for g in groups] == ["crashed: 1 trial(s)", "oom: 1 trial(s)",
                                      "oom (pre-check, never launched): 1 trial(s)"]
    by = dict(groups)
    assert "trial 3 (max_num_seqs=200)" in by["oom: 1 trial(s)"]
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB" in by["oom: 1 trial(s)"]
    assert "trial 1 (baseline xinference-4.1)" in by["oom (pre-check, never launched): 1 trial(s)"]
    assert "RuntimeError: engine core died" in by["crashed: 1 trial(s)"]


def test_a_trial_that_lost_its_race_says_so_in_the_trials_table(tmp_path):
    """A pruned trial states no capacity: the table says why, in the console's words, not an empty cell."""
    d = study_toml(tmp_path)
    lost = measured(32, [(2.21, 0.90, 0.02)])  # missed the TTFT SLO at the incumbent's load
    lost = create_trial(params=lost.params, distributions=DIST, state=TrialState.PRUNED,
                        user_attrs={**lost.user_attrs, Attr.CAPACITY_RPS: 0.0,
                                    Attr.RACE: RaceRecord(0, 2.21, 1.0).ended(True, 2.21).to_json()})
    build(d, [*typical(), lost])
    page = report(d, tmp_path)
    rows = re.findall(r"<tr>(.*?)</tr>", re.search(r"<table id=\"trials\">(.*?)</table>", page, re.S).group(1), re.S)
    row = next(r for r in rows if r.startswith("<td>5</td>"))
    assert "lost the race to trial 0: missed the SLOs at 2.21 req/s, where it holds them" in row, row
    crashed = next(r for r in rows if r.startswith("<td>4</td>"))
    assert "crashed: RuntimeError: engine core died" in crashed, crashed


def test_what_a_study_stored_is_escaped(tmp_path):
    d = study_toml(tmp_path)
    build(d, typical(with_hostile=True))
    page = report(d, tmp_path)
    assert HOSTILE not in page and "alert(1)" in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_the_page_opens_offline(tmp_path):
    d = study_toml(tmp_path)
    build(d, typical())
    page = report(d, tmp_path)
    assert not re.search(r"<script[^>]*\bsrc\s*=", page, re.I)
    assert not re.search(r"<link\b", page, re.I) and "@import" not in page and "@font-face" not in page
    assert page.count("* plotly.js v") == 1  # the library once, in the head
    assert 'id="ladder-plot"' in page and 'id="history-plot"' in page


def test_importance_waits_for_enough_trials(tmp_path):
    d = study_toml(tmp_path)
    build(d, typical())
    importance = re.search(r'<section id="importance">(.*?)</section>', report(d, tmp_path), re.S).group(1)
    assert (f"Parameter importance needs at least {MIN_IMPORTANCE_TRIALS} completed trials (baselines not counted); "
            "this study has 1.") in importance
    assert "importance-plot" not in importance


def test_importance_is_plotted_once_there_are_enough_trials(tmp_path):
    d = study_toml(tmp_path)
    ladders = [[(1.0 + i / 4, 0.1 + i / 50, 0.02), (4.0, 0.9, 0.09)] for i in range(MIN_IMPORTANCE_TRIALS)]
    build(d, [measured(128, BASE, baseline="vllm-defaults")]
          + [measured(8 + 16 * i, lad) for i, lad in enumerate(ladders)])
    page = report(d, tmp_path)
    importance = re.search(r'<section id="importance">(.*?)</section>', page, re.S).group(1)
    assert 'id="importance-plot"' in importance and "needs at least" not in importance


@pytest.mark.parametrize("with_predictions", [True, False])
def test_predicted_against_measured(tmp_path, with_predictions):
    d = study_toml(tmp_path)
    build(d, [measured(128, BASE, baseline="vllm-defaults", predicted=2.0 if with_predictions else None),
              measured(64, GOOD, predicted=4.0 if with_predictions else None)])
    section = re.search(r'<section id="predictions">(.*?)</section>', report(d, tmp_path), re.S).group(1)
    if with_predictions:
        assert "<td>1</td><td>max_num_seqs=64</td><td>4.00</td><td>3.20</td><td>-20 %</td>" in section
    else:
        assert "This study made no predictions." in section


def test_a_pareto_study_is_a_trade_off(tmp_path):
    d = study_toml(tmp_path, objective="pareto")
    study = optuna.create_study(study_name=d.name, storage=d.storage, directions=["maximize", "minimize"])
    for seqs, tok_s, ttft in ((64, 900.0, 0.12), (128, 1400.0, 0.25), (32, 800.0, 0.2)):
        attrs = {**base_attrs(seqs), Attr.STEPS: [step(2.0, ttft, 0.03)], Attr.CONSTRAINTS: [-0.1, -0.2]}
        study.add_trial(create_trial(params={"max_num_seqs": seqs}, distributions=DIST, values=[tok_s, ttft],
                                     state=TrialState.COMPLETE, user_attrs=attrs))
    page = report(d, tmp_path)
    assert first_line(page) == ("A trade-off, not a winner: 2 configuration(s) meet every SLO and none beats another "
                                "on both output throughput and p95 TTFT: trial 1 (max_num_seqs=128) 1400 tok/s at "
                                "250 ms; trial 0 (max_num_seqs=64) 900 tok/s at 120 ms.")
    assert 'id="history-plot"' in page


def test_a_winner_has_one_capacity_the_verdicts_and_a_trial_alone_shows_its_bracket(tmp_path):
    """best.yaml and best.json state the capacity the verdict states (the re-measured median, not the trial's
    first measurement); a config the verdict never measured states its trial's bracket: the load that held and
    the next one, which missed (issue 55: 30.87 in the files, 46.30 in the verdict)."""
    d = study_toml(tmp_path)
    study = build(d, typical(), runs=[(2, [3.5, 3.6, 3.7]), (0, [2.2, 2.21, 2.25])])  # trial 2 measured 3.2 once
    result = StudyResult.of(study)
    out = tmp_path / "files"
    out.mkdir()
    paths = write_verdict(result, "no/such-model", d.command.engine_kind, out)
    said = json.loads(paths["json"].read_text())["capacity_rps"]
    assert 3.5 < said < 3.9  # the posterior median of its trial's 3.2 bracket and re-measured 3.5-3.7
    assert f"# autotune: best config of trial 2, capacity {said:.2f} req/s (posterior median, 3 re-measurements)" in (
        paths["config"].read_text())
    assert f"{said:.2f} req/s" in first_line(report(d, tmp_path))  # the report's verdict says the same number
    # without a verdict: the trial's own capacity, as the bracket its ladder found (3.2 held, 4.0 missed)
    (tmp_path / "b").mkdir()
    alone = StudyResult.of(build(study_toml(tmp_path / "b"), typical()))
    assert alone.capacity_of(alone.trial(2)) == (3.2, "3.20 req/s (its next load, 4.00, missed)")
