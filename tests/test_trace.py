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
])
def test_bad_lines_name_file_and_line(tmp_path, line, needle):
    p = write(tmp_path, "bad.jsonl", '{"arrival_s": 0, "prompt": "ok", "output_tokens": 1}\n' + line + "\n")
    with pytest.raises(TraceFormatError) as e:
        read_workload(p)
    assert needle in str(e.value)
    assert "bad.jsonl:2" in str(e.value) or "bad.jsonl" in str(e.value)


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
