"""Property-based: no study file, daemon file, trace or command line reaches the user as a traceback.

For every generated input, ``autotune.cli.main`` either succeeds (exit 0) or exits 2 with exactly
one line on stderr, ``autotune: ...`` (``autotune: note: ...`` lines may come before it). An
exception that escapes ``main`` fails the test with its traceback, and Hypothesis shrinks the input.

Nothing is started: studies run with ``--dry-run`` and an engine command that does not exist;
where an input would be accepted and the command would go on to launch an engine, replay against
a server or serve clients, a stub stands in (after the command has checked everything it checks
before that) and the input counts as a success. Daemon files are read through ``autotune status``
(``autotune daemon`` would run for ever); ``autotune dashboard`` is left out (it starts a server).

The seed is fixed (``derandomize``) and the number of examples bounded, so CI runs the file in a
couple of minutes; ``AUTOTUNE_FUZZ_EXAMPLES`` raises the count per test for a longer run:

    AUTOTUNE_FUZZ_EXAMPLES=3000 .venv/bin/python -m pytest -q -s tests/test_fuzz.py

(``-s`` shows the count of inputs tried; ``AUTOTUNE_FUZZ_SHOW=1`` prints each input's exit code and last line.)
"""

from __future__ import annotations

import copy
import functools
import io
import json
import os
import sys
import threading
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import optuna
import pytest
import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autotune.cli import main
from tests.conftest import free_port

EXAMPLES = int(os.environ.get("AUTOTUNE_FUZZ_EXAMPLES", "500"))
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))
NO_ENGINE = "/nonexistent/autotune-fuzz/vllm serve"
TRIED = {"inputs": 0, "accepted": 0, "refused": 0, "tracebacks": 0}


class Reached(Exception):
    """A stub stood where an engine, a replay or a server would have started: the input was accepted."""


def run(argv: list[str]) -> None:
    """The property: exit 0, or exit 2 with one line; never an exception out of main."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(argv, measure_engine=_engine, measure_url=_replay)
        except SystemExit as e:  # argparse: --help, --version, usage errors
            code = e.code if isinstance(e.code, int) else 2
        except Reached:
            code = 0
        except BaseException:
            TRIED["tracebacks"] += 1
            raise
    lines = [x for x in err.getvalue().splitlines() if x.strip() and not x.startswith("autotune: note:")]
    if os.environ.get("AUTOTUNE_FUZZ_SHOW"):
        print(code, argv[:3], err.getvalue().strip()[-200:], file=sys.__stderr__)
    TRIED["inputs"] += 1
    TRIED["accepted" if code == 0 else "refused"] += 1
    assert code in (0, 2), f"exit {code} for {argv}: {err.getvalue()}"
    if code == 2:
        assert len(lines) == 1 and lines[0].startswith("autotune: "), f"{argv}: {err.getvalue()!r}"


def _engine(command, checked, workload_at, *rest, **kw):
    """Where ``bench`` would start its engine (main's measure_engine), its args checked by then (cmd_bench)."""
    workload_at(1.0)
    raise Reached


def _replay(*a, **kw):
    """Where ``replay`` would start sending (main's measure_url)."""
    raise Reached


@pytest.fixture(scope="module", autouse=True)
def _count():
    yield
    print(f"\nfuzz: {TRIED['inputs']} inputs tried ({TRIED['accepted']} accepted, {TRIED['refused']} refused), "
          f"{TRIED['tracebacks']} tracebacks")


@pytest.fixture(autouse=True)
def _stubs(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("AUTOTUNE_STATE_DIR", str(tmp_path_factory.mktemp("state")))

    from autotune.workload import capture

    stopped = threading.Event()
    stopped.set()  # the proxy binds, opens its trace and stops at once
    monkeypatch.setattr(capture, "run_capture", functools.partial(capture.run_capture, stop_event=stopped))


# --- what the inputs are made of ------------------------------------------------------------------

def mostly(good, bad) -> st.SearchStrategy:
    """Good values three times in four: an input with one mistake reaches further than one with five."""
    good, bad = (x if isinstance(x, st.SearchStrategy) else st.sampled_from(x) for x in (good, bad))
    return st.one_of(good, good, good, bad)


NUMBERS = mostly(["1", "2", "50", "0.5", "4"], ["0", "-1", "nan", "inf", "-inf", "1e309", "x", "", "3-5",
                                              "99999999999999999999", "\u00b2"])
TOKENS = mostly(["8", "4-16", "2", "0-8"], ["16-4", "0", "-", "5-", "-5", "x", "", "99999999999", "1-99999999999"])
SLOS = mostly(["ttft<800ms", "p99:tpot<50ms", "mean:e2e<2s", "throughput>10tok/s", "rps>1"],
              ["ttft", "ttft<", "x<1s", "ttft<-1ms", "p100:ttft<1s", "rps>nan", "ttft<1parsec", ""])
# what a shell can pass: any text but NUL
ARG = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=16)


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_model):
    """The files command lines point at: good and bad traces, tokenizers, study and daemon files, storages."""
    d = tmp_path_factory.mktemp("fuzz-files")
    (d / "timed.jsonl").write_text("".join(json.dumps({"arrival_s": i * 0.01, "prompt": f"q{i}", "output_tokens": 4})
                                           + "\n" for i in range(3)))
    (d / "tokens.jsonl").write_text('{"prompt_tokens": 12, "output_tokens": 4}\n{"prompt_tokens": 20, "output_tokens": 2}\n')
    (d / "share.json").write_text(json.dumps([
        {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"},
                           {"from": "gpt", "value": "hello there"}]},
        {"conversations": [{"from": "gpt", "value": "I speak first"}]}]))
    (d / "latin1.jsonl").write_bytes('{"prompt": "caf\u00e9", "output_tokens": 1}\n'.encode("latin-1"))
    (d / "empty.jsonl").write_text("")
    (d / "a-dir").mkdir()
    (d / "not-a-tokenizer.json").write_text('{"model": 5}')
    # runs_dir here: the storage the study "s" is made in below, and what `report`/`--dry-run` write, never ./runs
    study = {"name": "s", "slos": ["ttft<1s"], "runs_dir": str(d),
             "engine": {"command": NO_ENGINE, "model": "m", "platform": "cpu"},
             "workload": {"trace": str(d / "timed.jsonl")}, "budget": {"trials": 3}}
    (d / "study.toml").write_text(tomli_w.dumps(study))
    study["workload"] = {"scenario": "chat", "rate": 4, "requests": 3, "tokenizer": str(tiny_model),
                         "prompt_tokens": [8, 16], "prefix_tokens": [8, 16], "output_tokens": 4}
    (d / "synth.toml").write_text(tomli_w.dumps(study))
    (d / "daemon.toml").write_text(tomli_w.dumps(DAEMON | {"staging": {"study": str(d / "study.toml")}}))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optuna.create_study(study_name="s", storage=f"sqlite:///{d}/studies.db")
    return d


def paths(files: Path, good: str, *bad: str):
    return mostly([str(files / good)], [str(files / n) for n in bad] + [str(files / "missing" / "x"), ""])


def workload_options(files: Path, tiny_model: Path) -> dict[str, st.SearchStrategy[str]]:
    return {
        "--workload": paths(files, "timed.jsonl", "tokens.jsonl", "share.json", "latin1.jsonl", "empty.jsonl",
                            "a-dir", "study.toml"),
        "--scenario": mostly(["chat", "long-docs", "high-concurrency"], ["nope", ""]),
        "--rate": NUMBERS, "--requests": mostly(["1", "3"], ["0", "-2", "x", "1e3"]), "--burstiness": NUMBERS,
        "--seed": NUMBERS, "--prompt-tokens": TOKENS, "--output-tokens": TOKENS, "--prefix-tokens": TOKENS,
        "--api": mostly(["completion", "chat"], ["grpc"]),
        "--tokenizer": mostly([str(tiny_model)], [str(files / "not-a-tokenizer.json"), str(files / "a-dir"),
                                                  str(files / "timed.jsonl"), "/nonexistent"]),
        "--load": NUMBERS, "--max-concurrency": NUMBERS, "--warmup": NUMBERS, "--request-timeout": NUMBERS,
        "--slo": SLOS, "--json": paths(files, "out.json", "a-dir"),
    }


def command_line(files: Path, tiny_model: Path) -> st.SearchStrategy[list[str]]:
    wl = workload_options(files, tiny_model)
    commands: dict[str, tuple[list[str], dict[str, st.SearchStrategy[str]], list[str]]] = {
        # (fixed start, options with values, switches)
        "replay": (["replay", "--url", "http://127.0.0.1:9", "--workload", str(files / "timed.jsonl"),
                    "--requests", "2"], wl, []),
        "bench": (["bench", "--model", "m", "--engine-cmd", NO_ENGINE, "--workload", str(files / "timed.jsonl"),
                   "--requests", "2"], wl | {
            "--model": mostly(["m", str(tiny_model)], [""]),
            "--engine-cmd": mostly([NO_ENGINE], ["vllm 'serve", "", "  ", "/nonexistent \\"]),
            "--host": mostly(["127.0.0.1", "::1"], ["", "no.such.host.invalid"]),
            "--port": mostly([str(free_port())], ["0", "70000", "x", "-1"]),
            "--env": mostly(["A=1", "HF_TOKEN=abc", "A=b=c"], ["=x", "A"]),
            "--startup-timeout": NUMBERS, "--log-dir": paths(files, "logs"),
            "--vllm-version": mostly(["0.32", "0.33.1", "0.32.0+cpu", "v0.33"], ["9.9", ""]),
            "--engine-nice": NUMBERS,
        }, ["--allow-trust-remote-code"]),
        "study": (["study"], {
            "--slo": SLOS, "--trials": NUMBERS, "--timeout": mostly(["1h", "90s"], ["0", "-1s", "x"]),
            "--storage": mostly([f"sqlite:///{files}/studies.db"], ["nodb://x", "not a url", ""]),
            "--study-name": mostly(["s", "other"], ["", "a b"]),
        }, ["--no-remeasure"]),
        "report": (["report"], {
            "--storage": mostly([f"sqlite:///{files}/studies.db"], [
                "nodb://x", "not a url", "mysql://u@127.0.0.1/x", f"sqlite:///{files}/missing/s.db",
                f"sqlite:///{files}/timed.jsonl", ""]),
            "--study-name": mostly(["s"], ["other", ""]), "--out": paths(files, "report.html", "a-dir"),
        }, []),
        "capture": (["capture", "--upstream", "http://127.0.0.1:9", "--out", str(files / "captured.jsonl")], {
            "--listen": mostly([f"127.0.0.1:{free_port()}"], ["127.0.0.1:70000", ":8001", "x", "127.0.0.1:\u00b2",
                                                              "[::1]:0", "no.such.host.invalid:8001"]),
            "--upstream": mostly(["http://127.0.0.1:9", "https://127.0.0.1:9/v1"], ["127.0.0.1:9", "ftp://x",
                                                                                    "http://[::1", ""]),
            "--out": paths(files, "captured.jsonl", "a-dir"),
        }, ["--with-prompts"]),
        "rollback": (["rollback"], {"--to": NUMBERS}, []),
        "status": (["status"], {}, []),
        "retune": (["retune"], {"--reason": ARG}, []),
        "publish": (["publish"], {}, ["--approve", "--reject"]),
    }
    study_files = mostly([str(files / "study.toml"), str(files / "synth.toml")],
                         [str(files / "daemon.toml"), str(files / "latin1.jsonl"), str(files / "missing.toml")])
    daemon_files = mostly([str(files / "daemon.toml")],
                          [str(files / "study.toml"), str(files / "latin1.jsonl"), str(files / "missing.toml")])

    @st.composite
    def build(draw) -> list[str]:
        name = draw(st.sampled_from(sorted(commands)))
        start, options, switches = commands[name]
        argv = list(start)
        if name in ("study", "report"):
            argv.append(draw(study_files))
            if name == "study":  # never a real study: it would start engines
                argv += ["--dry-run", draw(mostly(["1", "2"], ["0", "-1", "x"]))]
        if name in ("rollback", "status", "retune", "publish"):
            argv += ["--config", draw(daemon_files)]
        for flag in draw(st.lists(st.sampled_from(sorted(options)), max_size=4)) if options else []:
            argv += [flag, draw(options[flag])]
        argv += draw(st.lists(st.sampled_from(switches), max_size=2)) if switches else []
        if draw(st.integers(0, 9)) == 0:  # now and then something no command takes
            argv.insert(draw(st.integers(1, len(argv))), draw(ARG))
        if name == "bench" and draw(st.booleans()):
            argv += ["--", *draw(st.lists(st.sampled_from(["--max-num-seqs", "64", "--swap-space", "4", "x",
                                                            "--trust-remote-code", "--no-enable-prefix-caching",
                                                            "--max-num-seqs=abc", "--port", "--enforce-eager=1"]),
                                          max_size=4))]
        return argv

    return build()


@pytest.fixture(scope="module")
def lines(files, tiny_model):
    return command_line(files, tiny_model)


@FUZZ
@given(data=st.data())
def test_command_lines(lines, data):
    run(data.draw(lines))


# --- study files -------------------------------------------------------------------------------------

SCALARS = st.one_of(
    st.booleans(), st.integers(-3, 300), st.sampled_from([0, -1, 2 ** 63 - 1, 10 ** 9]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["", "0", "0s", "1s", "1h", "7d", "x", "ttft<1s", "vllm 'serve", "chat", "int", "true", "no",
                     "127.0.0.1:99999", "01:00-05:00", "25:00-01:00", "1e3", "80GiB", "\u00e9"]),
)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                             max_size=3), max_leaves=6)

# each key the files know, with values that fit it (the fuzzer also tries any value at all)
STUDY_KEYS: dict[str, list] = {
    "name": ["s2", "a.b-c_d"], "slos": [["ttft<1s"], ["p99:tpot<50ms", "rps>1"]], "seed": [0, 7],
    "runs_dir": ["runs-fuzz"], "storage": ["sqlite:///runs-fuzz/x.db"], "sampler": ["tpe", "random", "gp"],
    "precheck": [True, False], "heartbeat": ["30s", 10], "engine": [], "engine.model": ["m", "models/tiny-llama"],
    "engine.command": [NO_ENGINE, "/nonexistent/vllm-sim serve"], "engine.platform": ["cpu", "cuda"],
    "engine.port": [8150, 1, 65535], "engine.host": ["127.0.0.1", "::1"], "engine.nice": [0, 10, -5],
    "engine.kind": ["vllm", "vllm-sim"], "engine.startup_timeout": ["5m", 60], "engine.allow_trust_remote_code": [True],
    "engine.args": [{}, {"max_model_len": 2048}], "engine.args.enforce_eager": [True, False],
    "engine.args.trust-remote-code": [True], "engine.args.trust_remote_code": [True],
    "engine.env": [{}], "engine.env.HF_TOKEN": ["hf_abc"],
    "engine.gpu": [{"name": "NVIDIA H100 80GB HBM3", "memory": "80GiB"}, {"name": "x", "memory": 2 ** 34, "count": 2}],
    "engine.gpu.count": [1, 2], "space": [{}], "space.max_num_seqs": [{"type": "int", "low": 1, "high": 8, "default": 2}],
    "space.max_num_seqs.type": ["int", "float", "categorical"], "space.max_num_seqs.low": [1, 4],
    "space.max_num_seqs.high": [16, 256], "space.max_num_seqs.default": [8, 1], "space.max_num_seqs.log": [True],
    "space.gpu_memory_utilization": [{"type": "float", "low": 0.5, "high": 0.9, "default": 0.8}],
    "space.VLLM_CPU_KVCACHE_SPACE": [{"type": "int", "low": 1, "high": 2, "default": 1, "env": True}],
    "workload": [], "workload.scenario": ["chat", "high-concurrency"], "workload.trace": ["timed.jsonl"],
    "workload.rate": [4, 0.5, 1000], "workload.requests": [1, 3], "workload.burstiness": [1, 0.5, 4],
    "workload.seed": [0, 3], "workload.prompt_tokens": [8, [4, 16]], "workload.output_tokens": [4, [1, 8]],
    "workload.prefix_tokens": [[0, 0], [4, 8]], "workload.prefix_groups": [1, 2], "workload.api": ["chat", "completion"],
    "workload.tokenizer": ["models/tiny-llama"], "objective": [], "objective.kind": ["capacity", "pareto"],
    "objective.start_load": [1, 0.5], "objective.max_steps": [1, 4], "objective.resolution": [1.25, 2],
    "objective.step_duration": ["10s", 5], "budget": [], "budget.trials": [1, 5], "budget.timeout": ["1h", 60],
    "baselines": [{}], "baselines.builtin": [[], ["vllm-defaults"]],
    "baselines.extra": [[{"name": "b", "values": {"max_num_seqs": 4}}]], "baselines.production": [{"max_num_seqs": 4}],
    "baselines.production.max_num_seqs": [4, 2], "remeasure.top": [1, 0], "remeasure.repeats": [2],
    "surprise": [], "engine.surprise": [],
}

DAEMON = {
    "name": "d", "slos": ["ttft<1s"],
    "production": {"url": "http://127.0.0.1:9", "config": "/nonexistent/p.yaml", "model": "m", "restart": ["/bin/true"]},
    "staging": {"study": "study.toml"},
    "watch": {"scrape_interval": "15s", "window": "10m"},
    "triggers": {"drift": 0.5, "breach_windows": 3, "every": "7d", "cooldown": "6h"},
    "tuning": {"windows": ["01:00-05:00"], "canary_requests": 60},
    "publish": {"approval": False},
    "metrics": {"listen": ""},
}
DAEMON_KEYS: dict[str, list] = {
    "name": ["prod", "a.b"], "slos": [["ttft<1s"], ["p99:tpot<50ms"]], "production": [],
    "production.url": ["http://127.0.0.1:8000", "https://x/v1"], "production.kind": ["vllm-config", "xinference"],
    "production.config": ["/nonexistent/q.yaml"], "production.model": ["m"],
    "production.restart": [["systemctl", "restart", "vllm"]], "production.health_timeout": ["15m", 60], "staging": [],
    "staging.study": [], "staging.trace": ["timed.jsonl", ""], "watch": [], "watch.scrape_interval": ["15s", 5],
    "watch.window": ["10m", 60], "triggers": [], "triggers.drift": [0.5, 2], "triggers.breach_windows": [1, 3],
    "triggers.every": ["7d", "0", 0, "12h"], "triggers.cooldown": ["6h", "1d"], "tuning": [],
    "tuning.windows": [[], ["22:00-04:00"]], "tuning.canary_requests": [10, 60], "publish": [],
    "publish.approval": [True, False], "metrics": [], "metrics.listen": ["", "127.0.0.1:9464"],
    "surprise": [], "production.surprise": [],
}


def mutate(base: dict, keys: dict[str, list]) -> st.SearchStrategy[bytes]:
    """``base`` with a few keys set (mostly to values that fit them, else to any TOML value) or removed;
    now and then its bytes damaged."""

    @st.composite
    def build(draw) -> bytes:
        data = copy.deepcopy(base)
        for key in draw(st.lists(st.sampled_from(sorted(keys)), min_size=1, max_size=3)):
            *parents, last = key.split(".")
            table = data
            for p in parents:
                if not isinstance(table.get(p), dict):
                    table[p] = {}
                table = table[p]
            if draw(st.integers(0, 4)) == 0:
                table.pop(last, None)
            else:
                # a copy: a later key may change a table drawn here, and the pool must stay as it was
                table[last] = copy.deepcopy(draw(mostly(keys[key], VALUES) if keys[key] else VALUES))
        raw = tomli_w.dumps(data).encode()
        damage = draw(st.integers(0, 9))
        if damage == 0:  # not UTF-8
            at = draw(st.integers(0, len(raw)))
            raw = raw[:at] + draw(st.sampled_from([b"\xff", b"\xe9", b"\xc3"])) + raw[at:]
        elif damage == 1:  # cut short
            raw = raw[:draw(st.integers(0, len(raw)))]
        return raw

    return build()


@pytest.fixture(scope="module")
def study_base(files):
    return {"name": "s", "slos": ["ttft<1s"], "seed": 1,
            "engine": {"command": NO_ENGINE, "model": "m", "platform": "cpu", "args": {"max_model_len": 2048}},
            "space": {"max_num_seqs": {"type": "int", "low": 1, "high": 64, "default": 8}},
            "workload": {"trace": str(files / "timed.jsonl")}, "budget": {"trials": 3}}


@FUZZ
@given(data=st.data())
def test_study_files(files, study_base, data):
    p = files / "fuzzed-study.toml"
    p.write_bytes(data.draw(mutate(study_base, STUDY_KEYS)))
    run(["study", str(p), "--dry-run", "2"])


@FUZZ
@given(data=st.data())
def test_daemon_files(files, data):
    p = files / "fuzzed-daemon.toml"
    base = DAEMON | {"staging": {"study": str(files / "study.toml")}}
    p.write_bytes(data.draw(mutate(base, DAEMON_KEYS)))
    run(["status", "--config", str(p)])


# --- traces ------------------------------------------------------------------------------------------

FIELD_VALUES = st.one_of(st.integers(-3, 2000), st.sampled_from([2 ** 24 + 1, 2 ** 63, 10 ** 30, 1.5, 1e308, 0.0]),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8), st.booleans(),
                         st.none(), st.lists(st.integers(), max_size=2), st.sampled_from(["chat", "completion", "g"]))
GOOD_ROW = st.fixed_dictionaries(
    {"output_tokens": st.integers(1, 16)},
    optional={"arrival_s": st.floats(0, 0.5), "prompt": st.text(min_size=1, max_size=12),
              "prompt_tokens": st.integers(2, 64), "api": st.sampled_from(["chat", "completion"]),
              "prefix_group": st.sampled_from(["a", "b"]), "prefix_tokens": st.integers(0, 8)})
ROW = mostly(GOOD_ROW, st.dictionaries(st.sampled_from(["arrival_s", "prompt", "prompt_tokens", "output_tokens",
                                                        "prefix_group", "prefix_tokens", "api", "prefix", "colour"]),
                                       FIELD_VALUES, max_size=6))
TURN = mostly(
    st.fixed_dictionaries({"from": st.sampled_from(["human", "gpt", "system", "user", "assistant", "bing"]),
                           "value": st.text(max_size=12)}),
    st.one_of(st.dictionaries(st.sampled_from(["from", "value", "role"]), FIELD_VALUES, max_size=3), FIELD_VALUES))
SHAREGPT = st.lists(mostly(st.fixed_dictionaries({"conversations": st.lists(TURN, max_size=4)}),
                           st.one_of(st.dictionaries(st.sampled_from(["conversations", "id"]), FIELD_VALUES, max_size=2),
                                     FIELD_VALUES)), max_size=4)


@st.composite
def trace_bytes(draw) -> bytes:
    kind = draw(st.sampled_from(["jsonl", "jsonl", "sharegpt", "bytes"]))
    if kind == "jsonl":
        rows = draw(st.lists(mostly(ROW, st.one_of(FIELD_VALUES, st.text(max_size=10))), min_size=1, max_size=5))
        text = "\n".join(r if isinstance(r, str) and draw(st.booleans()) else json.dumps(r) for r in rows)
        return text.encode()
    if kind == "sharegpt":
        return json.dumps(draw(SHAREGPT)).encode()
    return draw(st.binary(max_size=40))


@FUZZ
@given(raw=trace_bytes(), rate=mostly([[], ["--rate", "50"]], [["--rate", "0"]]),
       out=st.sampled_from([[], ["--output-tokens", "4"]]), tok=st.booleans())
def test_traces(files, tiny_model, raw, rate, out, tok):
    p = files / "fuzzed-trace.jsonl"
    p.write_bytes(raw)
    run(["replay", "--url", "http://127.0.0.1:9", "--workload", str(p), *rate, *out,
         *(["--tokenizer", str(tiny_model)] if tok else [])])
