import math

import numpy as np
import pytest

from autotune.measure.metrics import RequestResult, request_value, summarize
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
