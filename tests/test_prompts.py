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
    newline = builder.tok.count("\n")
    by_group = {}
    for r in m.requests:
        by_group.setdefault(r.prefix_group, set()).add(r.prefix)
        assert builder.tok.count(r.prefix) == r.prefix_tokens
        assert builder.tok.count(r.prefix + "\n" + r.prompt) == r.prompt_tokens + newline  # as /v1/completions sends it
    assert all(len(texts) == 1 for texts in by_group.values())
    assert len({r.prompt for r in m.requests}) == len(m)  # no accidental sharing


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_shipped_scenario_gets_its_exact_lengths(builder, scenario):
    m = materialize(synthesize(scenario, rate=10, num_requests=60, seed=3), builder)
    for r in m.requests:
        assert builder.tok.count(r.prompt) == r.prompt_tokens - r.prefix_tokens


def test_a_tokenizer_that_merges_across_words_gets_corrected_texts(tmp_path):
    """Without a pre-tokenizer a BPE merges across spaces, so words joined are not one token each: the builder
    sees that and checks each text by re-encoding instead."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, trainers

    words = "alpha beta gamma delta epsilon zeta theta iota kappa lambda sigma omega".split()
    corpus = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(400)]
    hf = HFTokenizer(models.BPE())
    hf.decoder = decoders.Metaspace()
    hf.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    hf.save(str(tmp_path / "tokenizer.json"))
    merging = PromptBuilder(load_tokenizer(tmp_path))
    assert not merging.joins_exactly
    for n in (1, 5, 40):
        for seed in range(3):
            assert merging.tok.count(merging.text(n, seed)) == n


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
