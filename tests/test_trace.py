import json

import pytest

from autotune.errors import TraceFormatError
from autotune.workload.trace import Request, Workload, gamma_arrivals, read_workload, write_trace


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_autotune_trace_roundtrip(tmp_path):
    w = Workload((
        Request(0.0, 64, prompt_tokens=1500, prefix_group="sys", prefix_tokens=1024, api="chat"),
        Request(0.25, 16, prompt="hello there"),
    ), "t")
    p = tmp_path / "t.jsonl"
    write_trace(w, p)
    back = read_workload(p)
    assert back.requests == w.requests
    assert json.loads(p.read_text().splitlines()[1]) == {"arrival_s": 0.25, "output_tokens": 16, "prompt": "hello there"}


def test_trace_sorted_by_arrival(tmp_path):
    p = write(tmp_path, "a.jsonl", '{"arrival_s": 2, "prompt": "b", "output_tokens": 1}\n'
                                   '{"arrival_s": 1, "prompt": "a", "output_tokens": 1}\n')
    assert [r.prompt for r in read_workload(p).requests] == ["a", "b"]


def test_vllm_custom_jsonl_needs_rate(tmp_path):
    p = write(tmp_path, "c.jsonl", '{"prompt": "What is the capital of India?", "output_tokens": 10}\n'
                                   '{"prompt": "What is the capital of Iran?", "output_tokens": 1520}\n')
    with pytest.raises(TraceFormatError, match="give a request rate"):
        read_workload(p)
    w = read_workload(p, rate=10, seed=1)
    assert [r.output_tokens for r in w.requests] == [10, 1520]
    assert w.requests[0].arrival_s == 0.0 and w.requests[1].arrival_s > 0


def test_sharegpt(tmp_path):
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "one two three"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "lonely question"}]},
    ]
    p = write(tmp_path, "s.json", json.dumps(data))
    w = read_workload(p, rate=5, count_tokens=lambda s: len(s.split()))
    assert len(w) == 1  # the unanswered one has no output length
    assert (w.requests[0].prompt, w.requests[0].output_tokens, w.requests[0].api) == ("hi there", 3, "chat")
    with pytest.raises(TraceFormatError, match="tokenizer"):
        read_workload(p, rate=5)


def sharegpt(tmp_path, *conversations):
    return write(tmp_path, "s.json", json.dumps([{"conversations": [{"from": f, "value": v} for f, v in c]}
                                                 for c in conversations]))


def test_sharegpt_pairs_by_role(tmp_path):
    p = sharegpt(tmp_path,
                 [("system", "be brief"), ("human", "question one"), ("gpt", "a b c")],  # the system turn is no prompt
                 [("gpt", "hello, how can I help"), ("human", "question two"), ("gpt", "d e")],  # model first
                 [("user", "question three"), ("assistant", "f")],  # the other spelling of the roles
                 [("human", "asked twice"), ("human", "question four"), ("gpt", "g h i j")])  # the answered one
    w = read_workload(p, rate=5, count_tokens=lambda s: len(s.split()))
    assert [(r.prompt, r.output_tokens) for r in w.requests] == [
        ("question one", 3), ("question two", 2), ("question three", 1), ("question four", 4)]
    assert w.skipped == 0


def test_sharegpt_counts_what_it_skips(tmp_path):
    p = sharegpt(tmp_path,
                 [("human", "hi"), ("gpt", "hello there")],
                 [("human", "lonely question")],  # never answered
                 [("gpt", "the model talks to itself"), ("gpt", "and again")],  # no user turn
                 [("system", "be brief"), ("gpt", "ok")],  # a system turn is not a question
                 [("human", ""), ("gpt", "an answer to nothing")],  # an empty question
                 [("human", "empty answer"), ("gpt", "")],  # nothing to generate
                 [])
    w = read_workload(p, rate=5, count_tokens=lambda s: len(s.split()))
    assert [r.prompt for r in w.requests] == ["hi"]
    assert w.skipped == 6
    # the count survives what load does after reading: scaling arrivals, building prompts
    assert w.scaled(2).skipped == 6 and w.head(1).skipped == 6
    only_skips = sharegpt(tmp_path, [("gpt", "alone")])
    with pytest.raises(TraceFormatError, match="1 conversations skipped"):
        read_workload(only_skips, rate=5, output_tokens=4)


@pytest.mark.parametrize("turn", [{"value": "no role"}, {"from": "human"}, {"from": "human", "value": 5}, "text"])
def test_sharegpt_turns_need_a_role_and_text(tmp_path, turn):
    p = write(tmp_path, "s.json", json.dumps([{"conversations": [turn, {"from": "gpt", "value": "x"}]}]))
    with pytest.raises(TraceFormatError, match="entry 0: turn 0"):
        read_workload(p, rate=5, output_tokens=4)


def test_not_utf8_names_the_file(tmp_path):
    p = tmp_path / "latin1.jsonl"
    p.write_bytes('{"arrival_s": 0, "prompt": "caf\u00e9", "output_tokens": 4}\n'.encode("latin-1"))
    with pytest.raises(TraceFormatError, match="latin1.jsonl: not UTF-8"):
        read_workload(p)


@pytest.mark.parametrize("line,needle", [
    ('{"arrival_s": 0, "output_tokens": 5}', "needs prompt"),
    ('{"arrival_s": -1, "prompt": "x", "output_tokens": 5}', "arrival_s must be a number >= 0"),
    ('{"arrival_s": 0, "prompt": "x", "output_tokens": 0}', "output_tokens must be >= 1"),
    ('{"arrival_s": 0, "prompt": "x", "output_tokens": "5"}', "must be an integer"),
    ('{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 5, "prefix_tokens": 4}', "needs a prefix_group"),
    ('{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 5, "prefix_group": "g", "prefix_tokens": 10}', "must be below"),
    ('{"arrival_s": 0, "prompt": "x", "output_tokens": 5, "api": "grpc"}', "api must be"),
    ('{"arrival_s": 0, "prompt": "x", "output_tokens": 5, "colour": 1}', "unknown field(s) colour"),
    ('not json', "not valid JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"arrival_s": 0, "prompt_tokens": 99999999999, "output_tokens": 5}', "prompt_tokens must be <= 16777216"),
    ('{"arrival_s": 0, "prompt": "x", "prefix": 5, "output_tokens": 5}', "prefix must be a string"),
])
def test_bad_lines_name_file_and_line(tmp_path, line, needle):
    p = write(tmp_path, "bad.jsonl", '{"arrival_s": 0, "prompt": "ok", "output_tokens": 1}\n' + line + "\n")
    with pytest.raises(TraceFormatError) as e:
        read_workload(p)
    assert needle in str(e.value)
    assert "bad.jsonl:2" in str(e.value), str(e.value)  # the file and the line the bad record is on


def test_missing_file_and_empty(tmp_path):
    with pytest.raises(TraceFormatError, match="does not exist"):
        read_workload(tmp_path / "nope.jsonl")
    with pytest.raises(TraceFormatError, match="no requests"):
        read_workload(write(tmp_path, "e.jsonl", "\n"))


def test_gamma_arrivals_rate_and_burstiness():
    t = gamma_arrivals(20000, rate=50.0, burstiness=1.0, seed=3)
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))
    assert (len(t) - 1) / t[-1] == pytest.approx(50.0, rel=0.03)
    gaps_poisson = [b - a for a, b in zip(t, t[1:])]
    t2 = gamma_arrivals(20000, rate=50.0, burstiness=0.25, seed=3)
    gaps_bursty = [b - a for a, b in zip(t2, t2[1:])]
    cv = lambda g: (sum((x - sum(g) / len(g)) ** 2 for x in g) / len(g)) ** 0.5 / (sum(g) / len(g))
    assert cv(gaps_poisson) == pytest.approx(1.0, abs=0.05)  # exponential gaps
    assert cv(gaps_bursty) == pytest.approx(2.0, abs=0.15)  # gamma k=0.25: cv = 1/sqrt(k)


def test_scaled_workload():
    w = Workload(tuple(Request(t, 1, prompt="x") for t in (1.0, 2.0, 3.0)))
    assert [r.arrival_s for r in w.scaled(2.0).requests] == [0.0, 0.5, 1.0]
    assert w.rate == pytest.approx(1.0) and w.scaled(2.0).rate == pytest.approx(2.0)


def test_load_steps_need_a_finite_rate(tmp_path):
    """A study steps the load up from the workload's rate: requests that all arrive at once have none."""
    from autotune.errors import ConfigError
    from autotune.workload.source import LoadSteps, WorkloadSpec

    p = write(tmp_path, "burst.jsonl", '{"arrival_s": 0, "prompt": "a", "output_tokens": 2}\n'
                                       '{"arrival_s": 0, "prompt": "b", "output_tokens": 2}\n')
    with pytest.raises(ConfigError, match="arrives at once"):
        LoadSteps(WorkloadSpec(trace=p))
    assert len(LoadSteps(WorkloadSpec(trace=p, rate=4)).at(2.0)) >= 2
