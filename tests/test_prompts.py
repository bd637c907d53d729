import pytest

from autotune.errors import ConfigError
from autotune.workload.prompts import PromptBuilder, load_tokenizer, materialize
from autotune.workload.source import WorkloadSpec, load, parse_range
from autotune.workload.synth import SCENARIOS, synthesize


@pytest.fixture(scope="module")
def builder(tiny_model):
    return PromptBuilder(load_tokenizer(tiny_model))


@pytest.mark.parametrize("n", [1, 7, 128, 1000, 3000])
def test_exact_token_counts(builder, n):
    for seed in range(3):
        assert builder.tok.count(builder.text(n, seed)) == n


def test_shared_prefix_and_distinct_suffixes(builder):
    w = synthesize("chat", rate=10, num_requests=12, seed=1)
    m = materialize(w, builder)
    by_group = {}
    for r in m.requests:
        by_group.setdefault(r.prefix_group, set()).add(r.prefix)
        full = r.prefix + "\n" + r.prompt
        assert builder.tok.count(full) == pytest.approx(r.prompt_tokens, abs=2)
    assert all(len(texts) == 1 for texts in by_group.values())
    assert len({r.prompt for r in m.requests}) == len(m)  # no accidental sharing


def test_scenarios_have_their_shapes():
    chat = synthesize("chat", rate=5, num_requests=200, seed=0)
    assert all(r.api == "chat" and 1024 <= r.prefix_tokens <= 4096 for r in chat.requests)
    assert len({r.prefix_group for r in chat.requests}) == SCENARIOS["chat"].prefix_groups
    docs = synthesize("long-docs", rate=5, num_requests=200, seed=0)
    assert all(1024 <= r.prompt_tokens <= 8192 and r.prefix_group is None for r in docs.requests)
    hc = synthesize("high-concurrency", rate=50, num_requests=500, seed=0)
    assert max(r.prompt_tokens for r in hc.requests) <= 256
    assert hc.rate == pytest.approx(50, rel=0.15)


def test_source_needs_a_tokenizer_for_token_counts(tiny_model):
    spec = WorkloadSpec(scenario="high-concurrency", rate=5, num_requests=3)
    with pytest.raises(ConfigError, match="--tokenizer"):
        load(spec)
    w = load(WorkloadSpec(scenario="high-concurrency", rate=5, num_requests=3, tokenizer=tiny_model,
                          overrides={"prompt_tokens": (10, 10)}, output_tokens=4))
    assert all(r.has_text and r.output_tokens == 4 for r in w.requests)


def test_parse_range():
    assert parse_range("128", "x") == (128, 128)
    assert parse_range("64-256", "x") == (64, 256)
    with pytest.raises(ConfigError, match="low-high"):
        parse_range("9-3", "x")
    with pytest.raises(ConfigError, match="a number or a range"):
        parse_range("lots", "x")


def test_load_steps_keep_the_duration_and_draw_fresh_requests(tiny_model, tmp_path):
    from autotune.workload.source import LoadSteps
    from autotune.workload.trace import write_trace

    spec = WorkloadSpec(scenario="high-concurrency", rate=10, num_requests=50, tokenizer=tiny_model,
                        overrides={"prompt_tokens": (8, 16), "output_tokens": (4, 8)})
    steps = LoadSteps(spec)
    one, four = steps.at(1.0), steps.at(4.0)
    assert len(four) == pytest.approx(4 * len(one), rel=0.25)
    assert four.span_s == pytest.approx(one.span_s, rel=0.3)  # same duration, four times the rate
    assert not {r.prompt for r in one.requests} & {r.prompt for r in four.requests}  # no repeats to cache
    assert steps.at(4.0) is four  # built once

    trace = steps.base
    write_trace(trace, tmp_path / "t.jsonl")
    replayed = LoadSteps(WorkloadSpec(trace=tmp_path / "t.jsonl"), duration_s=steps.duration_s)
    three = replayed.at(3.0)
    assert len(three) == pytest.approx(3 * (len(trace) - 1), abs=1)  # the trace, replayed again from its start
    times = [r.arrival_s for r in three.requests]
    assert times == sorted(times) and three.span_s <= steps.duration_s * 1.05
