"""scripts/bench_replay.py end to end, briefly: the C exact-timing server (compiled with cc) and autotune's client in one and two
worker processes (the benchmark's own numbers are bench/README.md's, on a quiet host)."""

import json

from tests.conftest import free_port, script


def test_the_client_benchmark_runs_against_its_exact_timing_server(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = script("bench_replay").main(["--rates", "20", "--seconds", "1.5", "--tokens", "16", "--workers", "1,2",
                                        "--no-vllm", "--no-pin", "--port", str(free_port()), "--out", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())
    assert [r["client"] for r in rows] == ["autotune, 1 worker", "autotune, 2 workers"]
    for r in rows:
        assert r["failed"] == 0 and r["rate"] == 20
        # the server writes the first token 5 ms after reading the request: no client sees it sooner, and the
        # server's own record of it is the truth the client is compared with
        assert r["ttft_p50"] >= 0.005 and 0.005 <= r["truth_ttft_p99"] < 0.5, r
        assert 0.004 < r["tpot_p50"] < 0.05 and r["cpu_us_per_token"] > 0 and r["loop_lag_p99"] is not None, r
    assert "highest rate whose p99 TTFT stays within 2 ms" in capsys.readouterr().out
