import math

import pytest

from autotune.errors import SLOSyntaxError
from autotune.measure.slo import parse_slo, parse_slos


@pytest.mark.parametrize("text,metric,target,pct", [
    ("ttft<800ms", "ttft", 0.8, 95.0),
    ("p99:ttft<1s", "ttft", 1.0, 99.0),
    ("tpot<50ms", "tpot", 0.05, 95.0),
    ("mean:itl<20ms", "itl", 0.02, None),
    ("median:e2e<10s", "e2e", 10.0, 50.0),
    ("p99.9:ttft<2s", "ttft", 2.0, 99.9),
    ("  TTFT < 250 ms ", "ttft", 0.25, 95.0),
    ("e2el<3s", "e2e", 3.0, 95.0),
])
def test_latency_slos(text, metric, target, pct):
    slo = parse_slo(text)
    assert slo.metric == metric
    assert math.isclose(slo.target, target)
    assert slo.percentile == pct
    assert slo.upper_bound and slo.is_latency


def test_rate_slos():
    t = parse_slo("throughput>2000tok/s")
    assert (t.metric, t.target, t.upper_bound, t.percentile) == ("throughput", 2000.0, False, None)
    r = parse_slo("rps>5")
    assert (r.metric, r.target) == ("rps", 5.0)
    assert parse_slo("goodput>2.5req/s").target == 2.5


def test_default_percentile_is_visible_in_text_and_key():
    slo = parse_slo("ttft<800ms")
    assert slo.text == "p95:ttft<800ms"
    assert slo.key == "p95_ttft"
    assert parse_slo("mean:tpot<5ms").key == "mean_tpot"


def test_holds_and_violation():
    slo = parse_slo("ttft<800ms")
    assert slo.holds(0.5) and not slo.holds(0.8) and not slo.holds(None)
    assert slo.violation(0.4) == pytest.approx(-0.5)
    assert slo.violation(1.2) == pytest.approx(0.5)
    floor = parse_slo("throughput>100")
    assert floor.holds(150) and not floor.holds(50)
    assert not slo.holds(0.8) and not floor.holds(100)  # the bound itself misses, both ways
    assert floor.violation(50) == pytest.approx(0.5)
    assert floor.violation(None) == math.inf


@pytest.mark.parametrize("text,needle", [
    ("ttft", "quote it: --slo 'ttft<800ms'"),
    ("p99:ttft", "quote it"),
    ("ttft<", "no target value"),
    ("ttfb<1s", "unknown SLO metric 'ttfb'"),
    ("ttft>800ms", "latency SLOs use '<'"),
    ("ttft<800", "has no unit"),
    ("ttft<800m", "unknown unit 'm'"),
    ("p99:throughput>5", "no percentile"),
    ("throughput<5", "rate SLOs are floors"),
    ("p101:ttft<1s", "between p0 and p100"),
    ("rps>5tok/s", "unknown unit"),
    ("", "empty SLO"),
    ("ttft<<1s", "cannot read SLO"),
])
def test_errors_say_what_to_do(text, needle):
    with pytest.raises(SLOSyntaxError) as e:
        parse_slo(text)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_duplicate_slo_rejected():
    with pytest.raises(SLOSyntaxError, match="repeats"):
        parse_slos(["ttft<1s", "p95:ttft<2s"])
    assert len(parse_slos(["ttft<1s", "p99:ttft<2s"])) == 2


def test_a_verdict_without_a_measurement_is_stored_without_infinity():
    from autotune.measure.slo import Verdict

    slo = parse_slo("ttft<800ms")
    j = Verdict(slo, None).to_json()  # JSON (and Optuna's attrs) cannot hold inf
    assert j == {"slo": "p95:ttft<800ms", "key": "p95_ttft", "target": 0.8, "measured": None, "holds": False,
                 "violation": None}
    assert Verdict(slo, 1.2).to_json()["violation"] == pytest.approx(0.5)


@pytest.mark.parametrize("stat,ok", [("p0", False), ("p1", True), ("p0.5", True), ("p100", True), ("p100.5", False)])
def test_percentiles_from_above_zero_to_a_hundred(stat, ok):
    text = f"{stat}:ttft<1s"
    if ok:
        assert parse_slo(text).percentile == float(stat[1:])
    else:
        with pytest.raises(SLOSyntaxError, match="between p0 and p100"):
            parse_slo(text)


def test_errors_name_what_is_allowed_and_what_repeats():
    with pytest.raises(SLOSyntaxError) as e:
        parse_slo("ttfb<1s")
    assert "use one of ttft, tpot, itl, e2e, throughput, rps, goodput" in str(e.value)
    with pytest.raises(SLOSyntaxError) as e:
        parse_slos(["ttft<1s", "p95:ttft<2s"])
    assert "SLO 'p95:ttft<2s' repeats 'p95:ttft<1s'" in str(e.value)


def test_the_normalised_text_of_each_kind():
    assert parse_slo("mean:tpot<5ms").text == "mean:tpot<5ms"
    assert parse_slo("throughput>2000").text == "throughput>2000tok/s"
    assert parse_slo("rps>5/s").text == "rps>5req/s"
    assert parse_slo("goodput>2.5").text == "goodput>2.5req/s"


def test_more_errors_say_what_to_do():
    with pytest.raises(SLOSyntaxError, match="'ttft<0ms': a latency target must be above zero"):
        parse_slo("ttft<0ms")
    with pytest.raises(SLOSyntaxError, match=r"percentile p101 in 'p101:ttft<1s' must be"):
        parse_slo("p101:ttft<1s")
    with pytest.raises(SLOSyntaxError, match=r"rps takes req/s, /s \(or none\)"):
        parse_slo("rps>5tok/s")


@pytest.mark.parametrize("typed,advised", [
    ("ttft", "ttft<800ms"),  # the shell ate '<800ms'
    ("ttft800ms", "ttft<800ms"),  # only the '<' went missing: the target given is kept
    ("p99:tpot50ms", "p99:tpot<50ms"),
    ("rps5", "rps>5"),  # a rate is a floor
    ("latency2s", "latency<2s"),
])
def test_an_slo_without_its_comparison_is_told_one_that_parses(typed, advised):
    """The advice of the error, followed, works (issue 55: 'ttft800ms' was told --slo 'ttft800ms<800ms')."""
    with pytest.raises(SLOSyntaxError) as e:
        parse_slo(typed)
    assert f"--slo '{advised}'" in str(e.value), e.value
    parse_slo(advised)  # and it parses
