"""The autotune command as a user runs it: exit codes, one-line errors, JSON output."""

import json
import subprocess
import sys

import pytest

from tests.test_replay import server  # noqa: F401  (the fixed-timing server fixture)


def autotune(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "autotune", *args], capture_output=True, text=True, timeout=timeout)


def test_version_and_help():
    v = autotune("--version")
    assert v.returncode == 0 and v.stdout.startswith("autotune ")
    h = autotune("--help")
    assert h.returncode == 0 and "bench" in h.stdout and "replay" in h.stdout
    b = autotune("bench", "--help")
    assert "p95 unless" in b.stdout  # the default percentile is said in the help


@pytest.fixture
def trace(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps({"arrival_s": i * 0.02, "prompt": f"q{i}", "output_tokens": 4}) + "\n"
                         for i in range(10)))
    return p


def test_replay_slos_hold_exit_0_and_json(server, trace, tmp_path):  # noqa: F811
    out = tmp_path / "r.json"
    reqs = tmp_path / "r.jsonl"
    r = autotune("replay", "--url", server, "--workload", str(trace), "--slo", "ttft<2s", "--slo", "rps>1",
                 "--json", str(out), "--requests-json", str(reqs))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    for key in ("argv", "env", "started_at", "failure_class", "metrics", "slos"):
        assert key in data
    m = data["metrics"]
    assert m["completed"] == 10 and m["failed"] == 0
    for name in ("ttft", "tpot", "itl", "e2e"):
        assert set(m[name]) == {"count", "mean", "p50", "p90", "p95", "p99"}
    for name in ("request_throughput", "output_throughput", "goodput", "slo_attainment"):
        assert m[name] > 0
    assert [s["holds"] for s in data["slos"]] == [True, True]
    assert len(reqs.read_text().splitlines()) == 10
    assert "p95:ttft<2s" in r.stdout and "holds" in r.stdout


def test_replay_slo_miss_exit_1(server, trace):  # noqa: F811
    r = autotune("replay", "--url", server, "--workload", str(trace), "--slo", "ttft<1ms")
    assert r.returncode == 1
    assert "misses" in r.stdout


@pytest.mark.parametrize("args,needle", [
    (["replay", "--url", "http://x", "--scenario", "chat", "--rate", "1", "--slo", "ttft"], "quote it"),
    (["replay", "--url", "http://x"], "give a workload"),
    (["replay", "--url", "http://x", "--scenario", "nope", "--rate", "1"], "unknown scenario"),
    (["replay", "--url", "http://x", "--workload", "/nonexistent.jsonl"], "does not exist"),
    (["replay", "--url", "http://x", "--workload", "/nonexistent.jsonl", "--", "--max-num-seqs", "4"], "only go with bench"),
    (["bench"], "the following arguments are required: --model"),
    (["frobnicate"], "invalid choice"),
])
def test_usage_errors_exit_2_with_one_line(args, needle):
    r = autotune(*args)
    assert r.returncode == 2
    assert needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_bench_refuses_blog_flags_before_launch(tmp_path, trace):
    # --engine-cmd points at nothing runnable: the bundled table is used and nothing is started
    r = autotune("bench", "--model", "m", "--engine-cmd", f"{tmp_path}/no-vllm serve", "--vllm-version", "0.33",
                 "--workload", str(trace), "--log-dir", str(tmp_path / "logs"), "--", "--swap-space", "4")
    assert r.returncode == 2
    assert "--swap-space" in r.stderr and "--kv-offloading-size" in r.stderr
    assert not (tmp_path / "logs").exists()
