"""The rules that decide capacity: a load step, a session's outcome, the re-measurement's verdict.

Fast (no engine): pure values, and the replay against the fixed-timing server where the rule is
about what a real stream produces. ``scripts/mutation.sh`` mutates these modules and runs this file.
"""

import re

import pytest

from autotune.measure.metrics import RequestResult, lost_already, summarize
from autotune.measure.profiles import FixedLoad, Ladder
from autotune.measure.replay import ReplayOptions
from autotune.measure.session import MIN_OFFERED_SHARE, Outcome, Step, measure_url
from autotune.measure.slo import parse_slos
from autotune.workload.trace import Request, Workload
from tests.test_replay import fixed_timing_server

TTFT_MS, ITL_MS = 20.0, 5.0


@pytest.fixture(scope="module")
def server():
    with fixed_timing_server(TTFT_MS, ITL_MS) as url:
        yield url


def done(i, sent, ttft=0.05, itl=(0.01,), out=None, scheduled=None):
    out = len(itl) + 1 if out is None else out
    return RequestResult(i, sent if scheduled is None else scheduled, sent, True, ttft=ttft, itl=list(itl),
                         e2e=ttft + sum(itl), prompt_tokens=3, output_tokens=out, expected_output_tokens=out)


def step_of(load, results, slos=("ttft<1s",), rate_per_load=4.0):
    slo = parse_slos(list(slos))
    s = summarize(results, slo)
    return Step(load, rate_per_load * load, s, s.verdicts(slo), 1.0, results)


# --- a step with a failed request does not count (whatever its latencies) ---

def measure_on_schedule(url, workload, slos, profile, tries=3):
    """measure_url, measured again (not asserted again) while a stalled host kept the client off its schedule."""
    for _ in range(tries):
        out = measure_url(url, lambda load: workload, slos, ReplayOptions(warmup_requests=0), profile)
        if all(s.client_kept_up for s in out.steps):
            break
    assert all(s.client_kept_up for s in out.steps), "the client fell behind its schedule in every try"
    return out


def test_a_step_that_lost_a_request_on_a_real_stream_is_no_capacity(server):
    """Over HTTP: one request of six gets a 500; the others meet a generous SLO, yet the step fails."""
    prompts = ["ok", "ok", "please FAIL", "ok", "ok", "ok"]
    w = Workload(tuple(Request(i * 0.1, 4, prompt=p) for i, p in enumerate(prompts)))
    out = measure_on_schedule(server, w, parse_slos(["ttft<5s", "e2e<10s"]), Ladder(1.0, 1, 1.25))
    (step,) = out.steps
    assert (step.summary.completed, step.summary.failed) == (5, 1)
    assert step.slos_hold  # every SLO held on the requests that completed, and the load was offered
    assert not step.passed and out.capacity is None and out.capacity_rps == 0.0
    assert step.to_json()["passed"] is False
    # the ladder reads the step as a miss and halves
    assert Ladder(1.0, 4, 1.25).next_load([(step.load, step.passed)]) == 0.5


def test_the_same_step_without_the_failure_is_capacity(server):
    w = Workload(tuple(Request(i * 0.1, 4, prompt="ok") for i in range(6)))
    out = measure_on_schedule(server, w, parse_slos(["ttft<5s"]), FixedLoad())
    assert out.steps[0].passed and out.capacity is out.steps[0]
    assert out.capacity_rps == pytest.approx(w.rate)


def test_the_rule_is_the_same_when_summarized_from_results():
    slo = ("ttft<1s",)
    clean = [done(i, i * 0.1) for i in range(5)]
    lost = clean[:4] + [RequestResult(4, 0.4, 0.4, False, error="HTTP 500: boom", elapsed=0.01)]
    assert step_of(1, clean, slo).passed
    s = step_of(1, lost, slo)
    assert s.slos_hold and s.client_kept_up and not s.passed


# --- the ladder ---

def test_the_ladder_bisects_below_a_first_miss():
    # start at 1: miss; halve to 0.5: pass; then bisect geometrically between them (ratio 2 > 1.25)
    assert Ladder(1.0, 4, 1.25).next_load([(1.0, False), (0.5, True)]) == pytest.approx(0.5 ** 0.5)


def test_the_ladder_stops_when_the_bracket_is_exactly_the_resolution():
    assert Ladder(1.0, 8, 1.25).next_load([(1.0, True), (1.25, False)]) is None
    assert Ladder(1.0, 8, 1.25).next_load([(1.0, True), (1.5, False)]) == pytest.approx(1.5 ** 0.5)


# --- Step: the offered load ---

def test_offered_share_is_the_scheduled_span_over_the_sent_span():
    results = [done(i, sent=i * 0.125, scheduled=i * 0.1) for i in range(9)]  # sends stretched by 25 %
    s = step_of(1, results)
    assert s.offered_share == pytest.approx(0.8)
    assert not s.client_kept_up and not s.passed


def test_offered_share_is_measured_on_spans_not_on_times():
    # a step whose schedule does not start at zero: only the spans count
    results = [done(i, sent=1.0 + i * 0.125, scheduled=1.0 + i * 0.1) for i in range(9)]
    assert step_of(1, results).offered_share == pytest.approx(0.8)
    two = [done(0, sent=0.0, scheduled=0.0), done(1, sent=0.2, scheduled=0.1)]  # two sends are enough to judge
    assert step_of(1, two).offered_share == pytest.approx(0.5)


def test_sends_closer_than_scheduled_are_no_more_than_the_full_load():
    results = [done(i, sent=i * 0.05, scheduled=i * 0.1) for i in range(5)]
    assert step_of(1, results).offered_share == 1.0


def test_the_offered_share_threshold_is_inclusive():
    # sends stretched exactly to 1 / MIN_OFFERED_SHARE: the client offered just enough
    results = [done(i, sent=i * 0.5, scheduled=i * 0.5 * MIN_OFFERED_SHARE) for i in range(3)]
    s = step_of(1, results)
    assert s.offered_share == MIN_OFFERED_SHARE and s.client_kept_up
    nudged = [done(i, sent=i * 0.5, scheduled=i * 0.5 * MIN_OFFERED_SHARE * 1.000001) for i in range(3)]
    assert step_of(1, nudged).client_kept_up
    short = [done(i, sent=i * 0.5, scheduled=i * 0.5 * MIN_OFFERED_SHARE * 0.999) for i in range(3)]
    assert not step_of(1, short).client_kept_up


@pytest.mark.parametrize("results", [
    [],
    [done(0, 0.3, scheduled=0.0)],  # one request: no span to compare
    [done(0, 0.2, scheduled=0.0), done(1, 0.2, scheduled=0.1)],  # both left at once: no sent span
])
def test_too_few_sends_to_judge_count_as_offered(results):
    assert Step(1, 4, summarize(results), [], 1.0, results).offered_share == 1.0


def test_step_json_carries_the_verdicts_and_the_rates():
    results = [done(i, i * 0.1, ttft=0.05 * (i + 1)) for i in range(4)]
    s = step_of(2, results, ("p50:ttft<100ms", "rps>1"))
    j = s.to_json()
    assert (j["load"], j["rate"], j["passed"], j["client_kept_up"]) == (2, 8.0, s.passed, True)
    assert j["offered_share"] == 1.0 and j["replay_s"] == 1.0
    assert (j["completed"], j["failed"]) == (4, 0)
    assert j["request_throughput"] == s.summary.request_throughput
    assert j["output_throughput"] == s.summary.output_throughput
    assert j["goodput"] == s.summary.goodput and j["slo_attainment"] == s.summary.slo_attainment
    assert (j["ttft_p95"], j["tpot_p95"], j["e2e_p95"]) == (s.summary.ttft.p95, s.summary.tpot.p95, s.summary.e2e.p95)
    assert j["send_lag_p99"] == s.summary.send_lag.p99
    assert j["slos"] == [v.to_json() for v in s.verdicts]
    assert [v["slo"] for v in j["slos"]] == ["p50:ttft<100ms", "rps>1req/s"]


# --- Outcome: capacity ---

def test_capacity_is_the_highest_passing_load_not_the_last_step():
    ok = [done(i, i * 0.1) for i in range(3)]
    slow = [done(i, i * 0.1, ttft=5.0) for i in range(3)]
    out = Outcome("u", steps=[step_of(1, ok), step_of(2, ok), step_of(4, slow), step_of(2.8, ok), step_of(3.4, slow)])
    assert out.capacity is out.steps[3]
    assert out.capacity_rps == 4.0 * 2.8
    assert out.judged_step() is out.steps[3]
    assert out.last is out.steps[-1] and not out.slos_hold  # a single-load verdict reads the last step


def test_without_capacity_the_lowest_load_is_judged():
    slow = [done(i, i * 0.1, ttft=5.0) for i in range(3)]
    out = Outcome("u", steps=[step_of(1, slow), step_of(0.5, slow), step_of(0.7, slow)])
    assert out.capacity is None and out.capacity_rps == 0.0
    assert out.judged_step() is out.steps[1]
    assert Outcome("u").judged_step() is None and Outcome("u").last is None and not Outcome("u").slos_hold


def test_a_session_whose_engine_failed_does_not_hold_its_slos():
    from autotune.engine.failures import Failure, FailureClass

    out = Outcome("u", steps=[step_of(1, [done(0, 0.0), done(1, 0.1)])])
    assert out.slos_hold
    out.failure = Failure(FailureClass.CRASHED, "died")
    assert not out.slos_hold


def test_engine_start_time_is_to_ready_or_to_the_failure():
    assert Outcome("u", engine_ready_s=12.5).engine_start_s == 12.5
    assert Outcome("u", engine_failed_after_s=3.0).engine_start_s == 3.0
    assert Outcome("u").engine_start_s == 0.0
    out = Outcome("u", steps=[step_of(1, [done(0, 0.0)]), step_of(2, [done(0, 0.0)])])
    out.steps[1].replay_s = 2.5
    assert out.replay_s == 3.5


# --- the step loop: what each step is given and when it stops ---

def fake_replay(results, model="m", wall_s=0.4, warmup_s=0.1):
    from autotune.measure.replay import Replay

    return Replay(model, 0.0, results, wall_s, warmup_s)


class Recorder:
    """A replay_at for the step loop: answers recorded results and remembers what it was asked."""

    def __init__(self, results_at, failure_at=None, pause_s=0.02):
        self.results_at, self.failure_at, self.pause_s = results_at, failure_at or {}, pause_s
        self.calls = []

    def __call__(self, workload, options):
        import time

        self.calls.append((workload.rate, options))
        time.sleep(self.pause_s)
        n = len(self.calls)
        results = self.results_at(n)
        return (None if results is None else fake_replay(results)), self.failure_at.get(n)


def arrivals(rate, n=5):
    return Workload(tuple(Request(i / rate, 4, prompt="x") for i in range(n)))


def run_steps(replay_at, profile, slos=("ttft<1s",), on_step=lambda _: False, options=ReplayOptions(warmup_requests=4)):
    from autotune.measure.session import _run_steps

    out, phases = Outcome("u"), []
    _run_steps(out, replay_at, lambda load: arrivals(4.0 * load), parse_slos(list(slos)), profile, options,
               phases.append, on_step)
    return out, phases


def test_the_loop_climbs_the_ladder_and_warms_up_once():
    ok = [done(i, i * 0.1) for i in range(5)]
    rec = Recorder(lambda n: ok)
    out, phases = run_steps(rec, Ladder(1.0, 3, 1.25))
    assert [s.load for s in out.steps] == [1.0, 2.0, 4.0]
    assert phases == ["load step 1: 4.00 req/s", "load step 2: 8.00 req/s", "load step 3: 16.00 req/s"]
    warmups = [o.warmup_requests for _, o in rec.calls]
    assert warmups == [4, 0, 0]  # one warm-up per engine, not per step
    assert all(o.request_timeout_s == ReplayOptions().request_timeout_s for _, o in rec.calls)
    first = out.steps[0]
    assert first.model == "m" and first.warmup_s == 0.1 and first.measured_s == 0.4 and first.results == ok
    assert first.rate == pytest.approx(4.0)
    assert all(rec.pause_s <= s.replay_s < 5.0 for s in out.steps)  # each step's own wall time
    assert out.failure is None and not out.stopped_early and out.capacity is out.steps[-1]


def test_the_loop_judges_each_step_on_the_slos():
    mixed = [done(0, 0.0, ttft=0.1), done(1, 0.1, ttft=0.1), done(2, 0.2, ttft=3.0)]
    out, _ = run_steps(Recorder(lambda n: mixed), FixedLoad(), ("p50:ttft<1s",))
    (s,) = out.steps
    assert s.passed and [v.slo.text for v in s.verdicts] == ["p50:ttft<1s"]
    assert s.summary.slo_attainment == pytest.approx(2 / 3)  # the summary knows the SLOs: goodput per request
    assert s.summary.goodput == pytest.approx(2 / s.summary.duration_s)


def test_an_engine_failure_ends_the_loop_and_keeps_what_was_measured():
    from autotune.engine.failures import Failure, FailureClass

    died = Failure(FailureClass.CRASHED, "engine died under load")
    ok = [done(i, i * 0.1) for i in range(5)]
    out, _ = run_steps(Recorder(lambda n: ok, {2: died}), Ladder(1.0, 4, 1.25))
    assert out.failure is died and [s.load for s in out.steps] == [1.0, 2.0]
    out, _ = run_steps(Recorder(lambda n: None if n == 2 else ok, {2: died}), Ladder(1.0, 4, 1.25))
    assert out.failure is died and [s.load for s in out.steps] == [1.0]  # nothing measured at load 2


def test_on_step_sees_the_outcome_and_can_stop_it():
    ok = [done(i, i * 0.1) for i in range(5)]
    seen = []

    def on_step(out):
        seen.append(len(out.steps))
        return len(out.steps) == 2

    out, _ = run_steps(Recorder(lambda n: ok), Ladder(1.0, 4, 1.25), on_step=on_step)
    assert seen == [1, 2] and len(out.steps) == 2 and out.stopped_early


# --- over HTTP: measure_url and replay_on ---

def test_measure_url_records_where_when_and_every_result(server):
    import time

    seen = []
    t0 = time.time()
    w = Workload(tuple(Request(i * 0.01, 3, prompt="ok") for i in range(4)))
    out = measure_url(server, lambda load: w.scaled(load), parse_slos(["ttft<5s"]),
                      ReplayOptions(warmup_requests=0), Ladder(1.0, 2, 1.25), on_result=seen.append)
    assert out.url == server and t0 <= out.started_at <= time.time()
    assert len(out.steps) == 2 and out.steps[0].load == 1.0  # nothing stops the ladder early, pass or miss
    assert len(seen) == 8 and all(r.success for r in seen)
    assert out.replay_s <= out.wall_s < 30.0
    assert out.argv == [] and out.failure is None and not out.stopped_early


def test_outcome_json_is_the_last_steps_result(server):
    import autotune

    w = Workload(tuple(Request(i * 0.01, 3, prompt="ok") for i in range(4)))
    out = measure_url(server, lambda load: w, parse_slos(["ttft<5s"]), ReplayOptions(warmup_requests=1))
    j = out.to_json()
    last = out.last
    assert j["autotune_version"] == autotune.__version__
    assert (j["url"], j["argv"], j["env"], j["started_at"]) == (server, [], {}, out.started_at)
    assert j["failure"] is None and j["failure_class"] is None
    assert j["engine_start_s"] is None and j["engine_stop_s"] is None  # not our engine
    assert (j["model"], j["replay_s"], j["warmup_s"]) == ("fixed-timing", last.measured_s, last.warmup_s)
    assert j["metrics"] == last.summary.to_json() and j["metrics"]["completed"] == 4
    assert j["slos"] == [v.to_json() for v in last.verdicts] and j["slos_hold"] is True
    assert out.requests_json() == [r.to_json() for r in last.results]


def test_outcome_json_of_an_engine_that_failed_to_start():
    from autotune.engine.failures import Failure, FailureClass

    f = Failure(FailureClass.OOM, "CUDA out of memory", "...\nCUDA out of memory", 1)
    out = Outcome("http://127.0.0.1:1", argv=["vllm", "serve", "m"], env={"A": "1"}, failure=f,
                  engine_failed_after_s=2.0, engine_stop_s=0.3)
    j = out.to_json()
    assert j["failure"] == f.to_json() and j["failure_class"] == "oom"
    assert j["engine_start_s"] is None and j["engine_stop_s"] == 0.3
    assert (j["argv"], j["env"]) == (["vllm", "serve", "m"], {"A": "1"})
    assert j["model"] is None and j["replay_s"] is None and j["warmup_s"] is None and j["metrics"] is None
    assert j["slos"] == [] and j["slos_hold"] is False
    assert Outcome("u", argv=["x"], engine_ready_s=4.0).to_json()["engine_start_s"] == 4.0


class StandInEngine:
    """What replay_on needs of an engine: its URL and whether it has died (the launcher's check())."""

    def __init__(self, url, failure=None):
        self.url, self.failure = url, failure

    def check(self):
        return self.failure


def test_replay_on_a_live_engine(server):
    from autotune.measure.session import replay_on

    seen = []
    w = Workload(tuple(Request(i * 0.01, 3, prompt="ok") for i in range(3)))
    replay, failure = replay_on(StandInEngine(server), w, ReplayOptions(warmup_requests=0), seen.append)
    assert failure is None and len(replay.results) == 3 and len(seen) == 3


def test_replay_on_an_engine_that_died():
    from autotune.engine.failures import Failure, FailureClass
    from autotune.errors import MeasurementError
    from autotune.measure.session import replay_on
    from tests.conftest import free_port

    w = Workload((Request(0.0, 3, prompt="ok"),))
    gone = f"http://127.0.0.1:{free_port()}"
    died = Failure(FailureClass.CRASHED, "exited with 1")
    # nothing could be measured and the engine is dead: the death is the result
    assert replay_on(StandInEngine(gone, died), w, ReplayOptions(warmup_requests=0)) == (None, died)
    # nothing could be measured and the engine lives: a measurement problem
    with pytest.raises(MeasurementError):
        replay_on(StandInEngine(gone), w, ReplayOptions(warmup_requests=0))


def test_replay_on_an_engine_that_died_under_load(server):
    from autotune.engine.failures import Failure, FailureClass
    from autotune.measure.session import replay_on

    died = Failure(FailureClass.CRASHED, "exited with 1")
    replay, failure = replay_on(StandInEngine(server, died), Workload((Request(0.0, 3, prompt="ok"),)),
                                ReplayOptions(warmup_requests=0))
    assert failure is died and replay is not None and replay.results[0].success


# --- the re-measurement's verdict ---

def test_the_remeasurement_orders_finalists_the_trials_ladder_measured_alike():
    """Two configs 9 % apart that the trials' 1.25x ladder both put at load 6.09 (issue 25's prefix chat, at a
    base rate of 1 req/s) come apart when re-measured: each starts in the middle of its trial's bracket and
    gallops at 1.05x, within the trials' four steps; a config whose trial was lucky (its capacity below the
    load its trial held) is bisected downwards."""
    from autotune.study.scoring import REMEASURE_RESOLUTION, scoring_for

    scoring = scoring_for("capacity", 1.0, 4, 1.25)

    def remeasured(true: float) -> tuple[float, list[tuple[float, bool]]]:
        profile, tried = scoring.remeasure_profile(6.09), []
        while (load := profile.next_load(tried)) is not None:
            tried.append((load, load <= true))
        return max((load for load, ok in tried if ok), default=0.0), tried

    (low, low_steps), (high, high_steps) = remeasured(7.07), remeasured(7.71)
    assert low < high and 7.71 / high < 1.05 and 7.07 / low < REMEASURE_RESOLUTION
    assert len(low_steps) <= 4 and len(high_steps) <= 4  # the two extra steps serve a run far off
    lucky, lucky_steps = remeasured(6.0)
    assert 6.0 / 1.05 < lucky <= 6.0 and not lucky_steps[0][1]
    # a trial that stalled to 60 % of the config: the re-measurement still reaches a load it misses (no floor)
    stalled, stalled_steps = remeasured(6.09 / 0.6)
    assert stalled <= 6.09 / 0.6 < min(load for load, ok in stalled_steps if not ok) and len(stalled_steps) <= 6
    # a trial with no capacity at all starts from the study's first load
    assert scoring.remeasure_profile(0.0).next_load([]) == 1.0


def cand(label, caps, n=0):
    from autotune.engine.args import EngineArgs
    from autotune.study.records import Candidate

    return Candidate(label, n, EngineArgs({}, {}), capacities=list(caps))


def test_a_gain_is_deployed_when_the_posterior_gives_it_the_confidence_asked():
    from autotune.study.records import judge

    v = judge([cand("trial 2", [13.0, 12.0, 14.0], 2), cand("baseline", [11.0, 11.5, 10.0])])
    assert v.winner == "trial 2" and v.p_better >= 0.9 and v.significant and v.recommended_trial == 2
    assert v.gain_rps == pytest.approx(2.1, abs=0.2)  # posterior medians: ~13.2 over ~11.1
    assert "P = 0.98 that it is better, 0.9 required): deploy trial 2" in v.sentence(), v.sentence()
    # runs that overlap: the lead may be luck, and the baseline is kept
    v = judge([cand("trial 4", [12.0, 9.0, 11.0], 4), cand("baseline", [10.0, 10.5, 9.5])])
    assert v.winner == "trial 4" and 0.5 < v.p_better < 0.9 and not v.significant and v.recommended_trial == 0
    assert "not surely (P = 0.81 that it is better, 0.9 required): keep baseline" in v.sentence(), v.sentence()
    # the same evidence asked for less: deployed
    assert judge([cand("trial 4", [12.0, 9.0, 11.0], 4), cand("baseline", [10.0, 10.5, 9.5])], confidence=0.8).significant


def test_a_baseline_that_led_the_search_alone_is_kept_without_a_vacuous_probability():
    """Re-measured alone (the search's leader was the baseline), P(within 95 % of the best) is 1 by construction:
    the verdict says why it is kept instead; beside a searched config it states the probability."""
    from autotune.study.records import judge

    alone = judge([cand("baseline vllm-defaults", [46.3, 49.3])])
    assert alone.recommended_trial == 0 and not alone.significant
    assert alone.sentence() == ("no gain: no searched config beat baseline vllm-defaults, the search's leader; keep "
                                "baseline vllm-defaults")
    pair = judge([cand("trial 3", [40.0, 41.0], 3), cand("baseline vllm-defaults", [46.3, 49.3])])
    assert pair.recommended_trial == 0
    assert re.search(r"on the posterior median \(P = (0\.9\d|1\.00) that it is within 95 %", pair.sentence())


def test_the_verdicts_probability_on_cases_whose_answer_is_known():
    """Identical evidence: P(either is better) is a coin's; disjoint brackets measured many times: certain."""
    from autotune.study.posterior import Bracket, Posterior

    same = Posterior.of([[Bracket(10.0, 10.5)] * 20, [Bracket(10.0, 10.5)] * 20])
    assert same.p_better(0, 1) == pytest.approx(0.5, abs=0.03) and same.median(0) == same.median(1)
    apart = Posterior.of([[Bracket(20.0, 21.0)] * 5, [Bracket(10.0, 10.5)] * 5])
    assert apart.p_better(0, 1) == 1.0 and apart.p_within(1, 0.95) == 0.0
    assert 20.0 <= apart.median(0) <= 21.0 and 10.0 <= apart.median(1) <= 10.5
    # a floor says the capacity is above it, by how much unknown: it is not surely below a capacity just above it
    floor = Posterior.of([[Bracket(12.0, 13.5)] * 2, [Bracket(8.0, None)] * 2])
    assert 0.1 < floor.p_better(0, 1) < 0.9 and floor.median(1) > 8.0


def test_one_stalled_run_moves_a_capacity_a_little_and_not_the_verdict():
    """Three runs of the baseline, one of them stalled to 40 %: the heavy-tailed noise reads the stall as one,
    and the gain the other two runs (10, 12) and the winner's (15, 15.5) agree on stands."""
    from autotune.study.records import judge

    v = judge([cand("trial 1", [15.0, 15.5], 1), cand("baseline", [4.0, 10.0, 12.0])])
    assert v.significant and v.recommended_trial == 1
    assert v.candidates[-1]["median"] > 9.0  # not dragged to the 4


def test_a_capacity_is_known_to_its_ladders_step():
    """A capacity given without its runs is a bracket one ladder step wide: one run each, 10.6 over 10.0 on a
    1.10x ladder, overlaps and is no sure gain; the same gain seen three times on a 1.05x ladder is."""
    from autotune.study.records import judge

    assert not judge([cand("trial 1", [10.6], 1), cand("baseline", [10.0])], resolution=1.10).significant
    v = judge([cand("trial 1", [10.6, 10.6, 10.6], 1), cand("baseline", [10.0, 10.0, 10.0])])
    assert v.significant and v.resolution == 1.05


def test_the_search_measurement_counts_as_evidence():
    """The trial's own bracket is a measurement too: a stalled re-measurement of the winner does not undo it."""
    from autotune.study.posterior import Bracket
    from autotune.study.records import judge

    winner, base = cand("trial 1", [9.0], 1), cand("baseline", [10.0, 10.2])
    assert not judge([winner, base]).significant
    winner.evidence = [Bracket(15.0, 15.75), Bracket(15.2, 16.0)]
    v = judge([winner, base])
    assert v.winner == "trial 1" and v.significant


def test_the_verdict_lists_every_candidate():
    from autotune.study.records import Remeasurement, judge

    from autotune.measure.session import StepRecord

    cs = [cand("trial 1", [15.0, 14.0], 1), cand("baseline", [10.0, 10.5], 0)]
    cs[0].runs = [[StepRecord(1.0, 4.0, True), StepRecord(2.0, 8.0, False)], [StepRecord(2.0, 8.0, False)]]
    v = judge(cs)
    runs = v.candidates[0]["runs"]
    assert [[StepRecord.from_json(s) for s in run] for run in runs] == cs[0].runs  # stored as it reads back
    assert runs[0][0]["load"] == 1.0 and runs[1][0]["passed"] is False
    medians = [c.pop("median") for c in v.candidates]
    assert v.candidates == [
        {"label": "trial 1", "trial": 1, "capacities": [15.0, 14.0], "spread": 1.0, "runs": runs, "at_least": False},
        {"label": "baseline", "trial": 0, "capacities": [10.0, 10.5], "spread": 0.5, "runs": [], "at_least": False}]
    assert 4.0 <= medians[0] <= 8.0  # posterior medians: its runs' brackets ([4, 8) and below 8), not the figures
    assert 10.0 <= medians[1] <= 11.0  # its capacities, each known to the ladder's step
    v = judge(cs)
    assert v.candidate(1)["median"] == medians[0] and v.candidate(99) is None
    assert Remeasurement.from_json(v.to_json()) == v
    assert v.trials_seen == 0  # not told how many trials it saw: stale as soon as the study has one


def test_a_candidate_never_measured_has_no_capacity():
    c = cand("trial 3", [])
    assert c.median == 0.0 and c.spread == 0.0
    c = cand("t", [3.0, 9.0, 4.0])
    assert c.median == 4.0 and c.spread == 2.0  # twice the median absolute deviation: the 9 stands alone


# --- what the SLO grammar tells a user who got it wrong ---

@pytest.mark.parametrize("text,hint", [
    ("p99:ttft", "quote it: --slo 'p99:ttft<800ms' (unquoted, the shell reads < as a redirection and drops the rest)"),
    ("ttft<<1s", "e.g. --slo 'ttft<800ms', --slo 'p99:tpot<50ms', --slo 'throughput>2000tok/s'"),
])
def test_slo_errors_end_with_a_line_to_copy(text, hint):
    from autotune.errors import SLOSyntaxError
    from autotune.measure.slo import parse_slo

    with pytest.raises(SLOSyntaxError) as e:
        parse_slo(text)
    assert str(e.value).endswith(hint)


def test_a_request_record_carries_its_tpot():
    r = done(0, 0.0, ttft=0.1, itl=(0.02, 0.04))
    j = r.to_json()
    assert j["tpot"] == r.tpot == pytest.approx(0.03)
    assert set(j) == {"index", "scheduled_s", "sent_s", "success", "error", "ttft", "itl", "e2e", "prompt_tokens",
                      "output_tokens", "expected_output_tokens", "elapsed", "tpot"}


def test_a_step_states_the_rate_it_offers_not_its_few_arrivals(tmp_path):
    """Short steps of a Poisson trace: 5 arrivals can span 0.6 s or 2.4 s, so their own mean rate is noise
    (a daemon soak measured a step at load 2 as 3.7 req/s and the one at load 1 as 7.0, and ranked a config
    that passed both below one that passed only the first). A step offers the base rate x its load."""
    import json
    import random

    from autotune.measure.session import _run_steps
    from autotune.workload.source import LoadSteps, WorkloadSpec

    rng, t, lines = random.Random(3), 0.0, []
    for i in range(200):
        t += rng.expovariate(2.5)
        lines.append(json.dumps({"arrival_s": round(t, 4), "prompt": f"request {i}", "output_tokens": 4}))
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    steps = LoadSteps(WorkloadSpec(trace=trace), duration_s=2.0)
    base = steps.base.rate
    sampled = {load: steps.at(load).rate for load in (1.0, 2.0, 4.0)}
    assert any(abs(r / (base * load) - 1) > 0.2 for load, r in sampled.items()), sampled  # the noise is real here
    assert [steps.at(load).load_rate for load in (1.0, 2.0, 4.0)] == pytest.approx([base, 2 * base, 4 * base])

    def passes_all(workload, options):
        results = [done(i, r.arrival_s) for i, r in enumerate(workload.requests)]
        return fake_replay(results), None

    out = Outcome("u")
    _run_steps(out, passes_all, steps.at, parse_slos(["ttft<1s"]), Ladder(1.0, 3, 1.25), ReplayOptions(),
               lambda _: None, lambda _: False)
    assert [s.rate for s in out.steps] == pytest.approx([base, 2 * base, 4 * base])
    assert out.capacity_rps == pytest.approx(4 * base)  # the highest load that passed, stated as it was offered


# --- ITL gaps of events that arrived in one read: said beside the table, not left as a bare 0.0 ms ---

def test_events_read_together_are_counted_and_said_beside_itl():
    from autotune.measure.tables import outcome_tables

    together = [done(0, 0.0, itl=(0.0, 0.00002, 0.04)), done(1, 0.1, itl=(0.0, 0.05))]
    out = Outcome("u", steps=[step_of(1, together)])
    assert out.last.summary.itl_same_read == pytest.approx(3 / 5)
    latency = next(t for t in outcome_tables(out, None) if t.title == "latency (ms)")
    assert latency.caption.startswith("ITL: the gap between streamed events, as vllm bench serve measures it; 60% of "
                                      "gaps are under 0.1 ms")
    spaced = Outcome("u", steps=[step_of(1, [done(0, 0.0, itl=(0.01, 0.02))])])
    assert spaced.last.summary.itl_same_read == 0.0
    assert next(t for t in outcome_tables(spaced, None) if t.title == "latency (ms)").caption is None


def _ladder(*steps):
    """A run's load steps: (load, passed), and False in the third place for a step the client could not offer."""
    from autotune.measure.session import StepRecord

    return [StepRecord(x[0], x[0], x[1], client_kept_up=x[2] if len(x) > 2 else True) for x in steps]


def test_a_ladder_that_never_missed_has_a_floor_not_a_capacity():
    from autotune.study.records import held_every_load

    assert held_every_load(_ladder((1.0, True), (2.0, True), (4.0, True)))
    assert not held_every_load(_ladder((1.0, True), (2.0, False), (1.41, True)))
    assert not held_every_load(_ladder((1.0, False), (0.5, False)))  # no capacity at all: nothing to call a floor
    # a load the client could not offer says nothing of the engine: the capacity below it is still a floor
    assert held_every_load(_ladder((1.0, True), (2.0, False, False)))
    assert not held_every_load(_ladder((2.0, False), (1.0, True)))  # a miss above bounds it, whatever the order


def test_no_gain_is_stated_over_a_baseline_that_held_every_load():
    from autotune.study.records import judge

    base = cand("baseline vllm-defaults", [8.0, 8.0])
    base.runs = [_ladder((2.0, True), (4.0, True), (8.0, True))] * 2  # stopped at its last step, never missed
    winner = cand("trial 3", [12.0, 12.0], 3)
    winner.runs = [_ladder((2.0, True), (4.0, True), (8.0, True), (16.0, False), (11.3, True), (13.5, False))] * 2
    v = judge([winner, base])
    assert v.winner == "trial 3" and v.gain_rps == pytest.approx(4.3, abs=0.3) and v.baseline_at_least
    assert not v.significant and v.recommended_trial == base.trial_number
    assert v.sentence().startswith("no gain can be stated: baseline vllm-defaults held every load the ladder "
                                   "offered"), v.sentence()

    # the other way round: a winner that never missed, over a baseline that did, gains at least that much
    bounded = cand("baseline", [4.0, 4.0])
    bounded.runs = [_ladder((2.0, True), (4.0, True), (8.0, False), (5.7, False))] * 2
    v = judge([base, bounded])
    assert v.significant and not v.baseline_at_least
    assert v.sentence().startswith("baseline vllm-defaults beats baseline by at least 3."), v.sentence()  # 8 over [4, 5.7)


def sent(i: float, ttft: float | None = None, e2e: float | None = None, error: str = "") -> RequestResult:
    """A request sent at ``i`` s: answered (ttft, e2e), failed (error) or still waiting (neither)."""
    return RequestResult(int(i * 10), i, i, e2e is not None and not error, error, ttft, [], e2e)


@pytest.mark.parametrize(("text", "results", "total", "now", "lost"), [
    # nothing sent yet, or everything waiting less than the target: it can still pass
    ("ttft<1s", [], 10, 0.5, None),
    ("ttft<1s", [sent(0.0), sent(0.1)], 10, 0.9, None),
    # p95 of 10 values lies between the two largest: one request waiting 1 s is not enough, two are
    ("ttft<1s", [sent(0.0), sent(0.5)], 10, 1.2, None),
    ("ttft<1s", [sent(0.0), sent(0.1)], 10, 1.2, "p95:ttft<1s missed already: 1155 ms at least, with 2 of 10 sent"),
    # answered requests count with their own TTFT, waiting ones with their wait so far
    ("ttft<1s", [sent(0.0, 1.5, 2.0), sent(0.1)], 10, 1.2, "p95:ttft<1s missed already"),
    ("ttft<1s", [sent(0.0, 0.1, 2.0), sent(0.1, 0.1)], 10, 5.0, None),
    # a mean counts the unsent as instant answers: 3 s + 2.5 s waited over 4 requests
    ("mean:e2e<1s", [sent(0.0), sent(0.5)], 4, 3.0, "mean:e2e<1s missed already: 1375 ms at least"),
    ("mean:e2e<2s", [sent(0.0), sent(0.5)], 4, 3.0, None),
    # a failed request loses the step whatever the latencies
    ("ttft<1s", [sent(0.0, 0.1, 0.2), sent(0.1, error="HTTP 500: boom\nsecond line")], 10, 0.3,
     "request 1 failed (second line)"),
    # TPOT waits for the end: a request's future tokens are unknown
    ("tpot<1ms", [sent(0.0, 0.1), sent(0.1, 0.1)], 10, 9.0, None),
])
def test_a_step_is_lost_already_only_when_no_ending_can_pass_it(text, results, total, now, lost):
    why = lost_already(parse_slos([text]), results, total, now)
    assert why == lost if lost is None else why.startswith(lost), why
