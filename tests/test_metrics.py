import math

import numpy as np
import pytest

from autotune.measure.metrics import Distribution, RequestResult, request_value, summarize
from autotune.measure.slo import parse_slos


def ok(i, sent, ttft, itl, out, prompt=10):
    e2e = ttft + sum(itl)
    return RequestResult(i, sent, sent, True, ttft=ttft, itl=list(itl), e2e=e2e, prompt_tokens=prompt,
                         output_tokens=out, expected_output_tokens=out)


def test_tpot_is_vllm_definition():
    r = ok(0, 0.0, 0.1, [0.02, 0.04, 0.03], 4)
    assert r.tpot == pytest.approx((r.e2e - 0.1) / 3)
    assert ok(1, 0.0, 0.1, [], 1).tpot is None  # one token: no TPOT


def test_summary_arithmetic():
    results = [
        ok(0, 0.0, 0.1, [0.01] * 9, 10),
        ok(1, 0.5, 0.3, [0.02] * 9, 10),
        RequestResult(2, 0.9, 0.9, False, error="HTTP 500: boom", elapsed=0.01),
    ]
    s = summarize(results, parse_slos(["ttft<200ms"]))
    assert (s.requests, s.completed, s.failed) == (3, 2, 1)
    # duration: first send (0.0) to last end (0.5 + 0.3 + 0.18; the failure ended at 0.91)
    assert s.duration_s == pytest.approx(0.98)
    assert s.output_tokens == 20 and s.prompt_tokens == 20
    assert s.request_throughput == pytest.approx(2 / 0.98)
    assert s.output_throughput == pytest.approx(20 / 0.98)
    assert s.total_token_throughput == pytest.approx(40 / 0.98)
    assert s.ttft.mean == pytest.approx(0.2)
    assert s.ttft.p50 == pytest.approx(0.2)
    assert s.ttft.p99 == pytest.approx(np.percentile([0.1, 0.3], 99))
    assert s.itl.count == 18
    # only request 0 meets ttft<200ms; the failed one counts in the attainment's denominator
    assert s.goodput == pytest.approx(1 / 0.98)
    assert s.slo_attainment == pytest.approx(1 / 3)
    assert s.errors == {"HTTP 500: boom": 1}


def test_verdicts_use_the_slo_percentile():
    results = [ok(i, 0.0, t, [0.01], 2) for i, t in enumerate(np.linspace(0.1, 1.0, 100))]
    s = summarize(results)
    p95, p99 = parse_slos(["ttft<960ms", "p99:ttft<960ms"])
    v95, v99 = s.verdicts([p95, p99])
    assert v95.measured == pytest.approx(np.percentile(np.linspace(0.1, 1.0, 100), 95))
    assert v95.holds and not v99.holds


def test_rate_verdicts():
    results = [ok(i, i * 0.1, 0.05, [0.01] * 4, 5) for i in range(10)]
    s = summarize(results)
    tput, rps = parse_slos(["throughput>1tok/s", "rps>100"])
    vt, vr = s.verdicts([tput, rps])
    assert vt.holds and vt.measured == pytest.approx(s.output_throughput)
    assert not vr.holds


def test_empty_and_all_failed():
    s = summarize([RequestResult(0, 0, 0, False, error="x")], parse_slos(["ttft<1s"]))
    assert s.completed == 0 and s.ttft.count == 0 and s.ttft.p95 is None
    assert s.verdicts(parse_slos(["ttft<1s"]))[0].holds is False
    assert s.slo_attainment == 0.0
    assert math.isnan(summarize([]).slo_attainment)


def test_request_values_per_metric():
    slos = {s.metric: s for s in parse_slos(["ttft<1s", "tpot<1s", "p50:itl<1s", "e2e<1s"])}
    r = ok(0, 0, 0.2, [0.01, 0.03, 0.02], 4)
    assert request_value(slos["ttft"], r) == 0.2
    assert request_value(slos["e2e"], r) == pytest.approx(0.26)
    assert request_value(slos["itl"], r) == pytest.approx(0.02)
    assert request_value(slos["tpot"], r) == pytest.approx(0.02)


def test_tpot_of_short_outputs_for_goodput():
    """vLLM counts a successful 1-token request's TPOT as 0 (it meets any TPOT target); 2 tokens have a real one."""
    (tpot,) = parse_slos(["tpot<1ms"])
    one = ok(0, 0.0, 0.1, [], 1)
    two = ok(1, 0.0, 0.1, [0.05], 2)
    assert request_value(tpot, one) == 0.0
    assert request_value(tpot, two) == two.tpot == pytest.approx(0.05)
    failed = RequestResult(2, 0.0, 0.0, False, error="HTTP 500")
    assert request_value(tpot, failed) is None
    s = summarize([one, two, failed], [tpot])
    assert s.slo_attainment == pytest.approx(1 / 3)  # only the 1-token request meets tpot<1ms


def test_no_tpot_without_a_complete_timing():
    timed = dict(ttft=0.1, itl=[0.02] * 4, e2e=0.18, output_tokens=5)
    assert RequestResult(0, 0, 0, True, **timed).tpot == pytest.approx(0.02)
    assert RequestResult(0, 0, 0, False, error="cut off", **timed).tpot is None  # a failed request has none
    assert RequestResult(0, 0, 0, True, **{**timed, "ttft": None}).tpot is None
    assert RequestResult(0, 0, 0, True, **{**timed, "e2e": None}).tpot is None


def test_rate_slos_are_judged_on_the_run_rates():
    results = [ok(i, i * 0.1, 0.05, [0.01] * 4, 5) for i in range(10)]
    rps, goodput = parse_slos(["rps>1", "goodput>1"])
    s = summarize(results, [rps, goodput])
    assert s.value(rps) == s.request_throughput and s.value(goodput) == s.goodput
    assert s.goodput == s.request_throughput  # no latency SLO: every completed request is good


def test_a_mean_slo_is_judged_on_the_mean():
    results = [ok(i, 0.0, 0.1, [0.01 * (i + 1)] * 3, 4) for i in range(5)]
    s = summarize(results)
    (mean_tpot,) = parse_slos(["mean:tpot<1s"])
    assert s.value(mean_tpot) == pytest.approx(np.mean([0.01, 0.02, 0.03, 0.04, 0.05]))


def test_itl_per_request():
    """A request's ITL value is its own percentile of its gaps (mean:itl takes its largest gap); no gaps: 0."""
    p50, mean = parse_slos(["p50:itl<1s", "mean:itl<1s"])
    r = ok(0, 0, 0.2, [0.01, 0.05, 0.02], 4)
    assert request_value(p50, r) == pytest.approx(0.02)
    assert request_value(mean, r) == pytest.approx(0.05)
    one = ok(1, 0, 0.2, [], 1)
    assert request_value(p50, one) == 0.0
    assert request_value(p50, RequestResult(2, 0, 0, False, error="x")) is None


def test_rates_have_no_per_request_value():
    (tput,) = parse_slos(["throughput>10"])
    with pytest.raises(ValueError, match="throughput is not a per-request metric"):
        request_value(tput, ok(0, 0, 0.1, [0.01], 2))


def test_distribution_percentiles_are_numpys():
    samples = [float(x) for x in range(1, 101)]
    d = Distribution.of(samples)
    expected = np.percentile(samples, [50, 90, 95, 99])
    assert (d.count, d.mean) == (100, pytest.approx(50.5))
    assert [d.p50, d.p90, d.p95, d.p99] == pytest.approx(list(expected))


def test_duration_and_send_lag_are_spans_not_clock_times():
    # a replay whose first send is 2 s into the clock: only the spans count
    results = [RequestResult(i, 2.0 + i * 0.1, 2.0 + i * 0.1 + 0.01 * i, True, ttft=0.05, itl=[0.01], e2e=0.06,
                             output_tokens=2) for i in range(5)]
    s = summarize(results)
    assert s.duration_s == pytest.approx(0.4 + 0.04 + 0.06)
    assert s.send_lag.p50 == pytest.approx(0.02) and s.send_lag.count == 5
    assert s.e2e.count == 5 and s.e2e.p50 == pytest.approx(0.06) and s.e2e.mean == pytest.approx(0.06)


def test_nothing_measured_is_zero_per_second():
    s = summarize([])
    assert (s.requests, s.duration_s) == (0, 0.0)
    assert (s.request_throughput, s.output_throughput, s.total_token_throughput, s.goodput) == (0.0, 0.0, 0.0, 0.0)


def test_errors_are_counted_by_their_last_line():
    long = "x" * 300
    results = [RequestResult(0, 0, 0, False, error="Traceback ...\n  frame\nReadTimeout: timed out"),
               RequestResult(1, 0, 0, False, error="ReadTimeout: timed out"),
               RequestResult(2, 0, 0, False, error=""),
               RequestResult(3, 0, 0, False, error=long)]
    assert summarize(results).errors == {"ReadTimeout: timed out": 2, "unknown error": 1, "x" * 200: 1}
