"""vllm-sim against the calibration set: the benchmark script, the fit, and the API server's costs (issue 9)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from autotune.sim.config import SimConfig
from autotune.sim.fit import fit, log_loss
from autotune.sim.perf import FrontEnd
from autotune.sim.profiles import GPUS, model_shape
from autotune.sim.virtual import SimEngine, simulate
from autotune.measure.metrics import summarize
from autotune.workload.trace import Request, Workload

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_sim_fidelity.py"


def test_the_script_reproduces_points_and_prints_the_table(tmp_path):
    """A dense bf16 point and an AWQ (int4) one, both in the fit part, and a point of a model it cannot express
    (Qwen3.5's linear-attention layers): listed with the reason, out of the medians."""
    out = tmp_path / "fidelity.json"
    low_load = "gpustack-h100-qwen3-8b-sharegpt-c1"
    quantized = "gpustack-a100-qwen3-32b-awq-sharegpt-inf"
    hybrid = "gpustack-qwen35-9b-h100-sharegpt-burst-base"
    r = subprocess.run([sys.executable, str(SCRIPT), "--points", f"{low_load},{quantized},{hybrid}", "--json",
                        str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "## fit (2 of 2 points modelled" in r.stdout
    for text in (low_load, quantized, "model 'Qwen/Qwen3.5-9B' has no shape", "TTFT p50", "TPOT p50",
                 "median absolute error, fit: thr "):
        assert text in r.stdout, text
    assert "## held-out (" not in r.stdout  # the held-out point is not modelled: no table of none
    d = json.loads(out.read_text())
    rows = {p["id"]: p for p in d["points"]}
    assert rows[hybrid]["modelled"] is False and rows[quantized]["modelled"] is True
    assert rows[quantized]["values"]["thr"]["measured"] == 850.81
    v = rows[low_load]["values"]
    assert v["thr"]["measured"] == 132.86  # copied from the set, never derived
    for metric in ("thr", "ttft_p50", "ttft_mean", "tpot_p50", "tpot_mean", "itl_p50"):
        assert v[metric]["predicted"] > 0 and v[metric]["ratio"] == pytest.approx(
            v[metric]["predicted"] / v[metric]["measured"])
    ratios = sorted(abs(rows[k]["values"]["thr"]["ratio"] - 1) for k in (low_load, quantized))
    assert d["mdape"]["fit"]["thr"] == pytest.approx(sum(ratios) / 2)


def test_a_public_group_is_scored_on_its_knob_effect_and_its_points_on_their_regime(tmp_path):
    """Lambda's Llama-3-8B on 1-8 H100s (bench/public_groups.toml): the group's best/worst throughput measured and
    predicted, the ranking, and the held-out points' error in the tp-scaling regime; the TP-1 run is the
    calibration set's own fit point, so it counts in the group but not among the held-out points."""
    out = tmp_path / "groups.json"
    ids = ",".join(f"lambda-llama3-8b-h100-sharegpt320-tp-tp{n}" for n in (1, 2, 4, 8))
    r = subprocess.run([sys.executable, str(SCRIPT), "--points", ids, "--json", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(out.read_text())
    (g,) = d["knob_effects"]
    thr = {p["id"][-3:]: p["values"]["thr"] for p in d["points"]}
    assert g["configs"] == 4 and g["measured_ratio"] == pytest.approx(10242.68041198695 / 6026.61)  # copied
    assert g["predicted_ratio"] == pytest.approx(max(v["predicted"] for v in thr.values())
                                                 / min(v["predicted"] for v in thr.values()))
    assert -1 <= g["spearman"] <= 1 and 0 < g["first_pick_share"] <= 1
    tp = d["regimes"]["tp-scaling"]
    assert tp["points"] == 3  # tp2, tp4, tp8: held out
    assert tp["dense"] == [3, pytest.approx(tp["mdape"])] and tp["moe"] is None  # a dense model's points only
    assert "| lambda-llama3-8b-h100-sharegpt320-tp | h100-80gb |" in r.stdout
    assert "| tp-scaling | 3 |" in r.stdout


def fidelity_script():
    """scripts/bench_sim_fidelity.py as a module (scripts/ is not a package)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_sim_fidelity
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return bench_sim_fidelity


def test_a_random_workload_with_a_range_ratio_draws_lengths_within_it():
    """The vLLM blog's fp8-KV pair (bench/public_groups.toml): ~20k in, ~2k out, +-15 %, at concurrency 8. Each
    length is drawn within the range, the same draws every run, and they differ (fixed lengths finish in lockstep
    at a concurrency limit)."""
    import tomllib

    fidelity = fidelity_script()
    points = tomllib.loads((ROOT / "bench" / "public_groups.toml").read_text())["point"]
    point = next(p for p in points if p["id"] == "vllm-blog-fp8kv-llama8b-h100-bf16")
    workload, concurrency = fidelity.build_workload(point)
    ins = [r.prompt_tokens for r in workload.requests]
    outs = [r.output_tokens for r in workload.requests]
    assert concurrency == 8 and len(ins) == 150
    assert all(17000 <= n <= 23000 for n in ins) and all(1700 <= n <= 2300 for n in outs)
    assert len(set(outs)) > 100 and 19000 < sum(ins) / 150 < 21000
    assert [r.prompt_tokens for r in fidelity.build_workload(point)[0].requests] == ins


def test_a_point_whose_source_saved_each_requests_lengths_replays_them_and_the_others_draw_a_sample():
    """Lambda's result JSONs list each request's prompt and output tokens (bench/public_lengths.json): the point
    replays those, in order, an empty output as the one token that ended it; a ShareGPT point without them draws
    its lengths (log-normal, or Lambda's pairs as the what-if) scaled to its totals."""
    import json
    import tomllib

    fidelity = fidelity_script()
    points = {p["id"]: p for p in tomllib.loads((ROOT / "bench" / "sim_calibration.toml").read_text())["point"]}
    lambda_320 = points["lambda-h100-llama3-8b-sharegpt-320"]
    saved = json.loads(fidelity.LENGTHS.read_text())[lambda_320["source"]]
    reqs = fidelity.build_workload(lambda_320)[0].requests
    assert [r.prompt_tokens for r in reqs] == saved["input_lens"]
    assert [r.output_tokens for r in reqs] == [max(1, o) for o in saved["output_lens"]]
    assert sum(r.prompt_tokens for r in reqs) == lambda_320["workload"]["total_input_tokens"]

    gpustack = points["gpustack-h100-qwen3-32b-sharegpt-inf"]
    assert fidelity.published_lengths(gpustack) is None
    for shape in ("lognormal", "lambda"):
        drawn = fidelity.sharegpt_lengths(1000, 217393, 201422, shape=shape)
        assert abs(sum(p for p, _ in drawn) - 217393) < 1000 and abs(sum(o for _, o in drawn) - 201422) < 1000
        assert all(4 <= p <= 1024 and p + o <= 2048 + 4 for p, o in drawn)
    # Lambda's outputs end at 780 tokens; a log-normal of the same mean reaches past 1,000
    assert max(o for _, o in fidelity.sharegpt_lengths(320, 65578, 65331, shape="lambda")) < 1000
    assert max(o for _, o in fidelity.sharegpt_lengths(320, 65578, 65331)) > 1000


def test_the_script_refuses_unknown_points():
    r = subprocess.run([sys.executable, str(SCRIPT), "--points", "no-such-point"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 2 and "unknown point ids: no-such-point" in r.stderr


def _engine(gpu, front_end=None, era="v1"):
    shape = model_shape("llama-3.1-8b")
    config = replace(SimConfig.from_args({"max_model_len": 8192}, gpu, shape), era=era)
    if era == "v0":
        config = replace(config, async_scheduling=False)  # V0 had none
    return SimEngine.start(shape, gpu, config, front_end=front_end)


# a decode-heavy load (bandwidth binds) and a prefill-heavy burst (compute binds)
DECODE = Workload(tuple(Request(arrival_s=0.0, output_tokens=64, prompt_tokens=200) for _ in range(4)), "decode")
PREFILL = Workload(tuple(Request(arrival_s=0.0, output_tokens=2, prompt_tokens=4000) for _ in range(8)), "prefill")


def _observe(gpu) -> list[float]:
    d = summarize(simulate(_engine(gpu), DECODE))
    p = summarize(simulate(_engine(gpu), PREFILL))
    return [d.tpot.p50, d.e2e.p50, p.e2e.p50, p.ttft.mean]


def test_the_fit_recovers_known_constants_from_the_simulators_own_output():
    true = {"bandwidth_efficiency": 0.62, "compute_efficiency": 0.43}
    base = GPUS["h100-80gb"]
    measured = _observe(replace(base, **true))

    def loss(c):
        return log_loss(zip(measured, _observe(replace(base, **c))))

    got, value = fit(loss, {"bandwidth_efficiency": 0.85, "compute_efficiency": 0.70},
                     {"bandwidth_efficiency": (0.4, 1.0), "compute_efficiency": (0.2, 1.0)}, points=7, rounds=5)
    assert value < 1e-3
    for k, x in true.items():
        assert got[k] == pytest.approx(x, rel=0.05), (k, got)


def test_the_api_servers_floor_adds_to_ttft_and_its_serialized_costs_queue():
    gpu = GPUS["h100-80gb"]
    one = Workload((Request(arrival_s=0.0, output_tokens=8, prompt_tokens=100),), "one")
    bare = simulate(_engine(gpu), one)[0]
    floor = simulate(_engine(gpu, FrontEnd(latency_s=0.05)), one)[0]
    assert floor.ttft == pytest.approx(bare.ttft + 0.05)
    assert floor.e2e - floor.ttft == pytest.approx(bare.e2e - bare.ttft)  # TPOT is the engine's
    # a burst: the one API server process handles the requests one after another
    burst = Workload(tuple(Request(arrival_s=0.0, output_tokens=4, prompt_tokens=100) for _ in range(20)), "burst")
    queued = simulate(_engine(gpu, FrontEnd(request_s=0.01, prompt_token_s=1e-4)), burst)
    assert max(r.ttft for r in queued) >= 20 * (0.01 + 100 * 1e-4)
    fast_out = simulate(_engine(gpu), burst)
    # V0 detokenizes in the engine's own loop: every step's 20 tokens cost 40 ms before the next step, and the
    # client sees them that far apart
    slow_v0 = simulate(_engine(gpu, FrontEnd(output_token_s=0.002), era="v0"), burst)
    assert summarize(slow_v0).tpot.p50 >= 0.04 > summarize(fast_out).tpot.p50
    # V1 merges tokens into fewer chunks, but each token's own cost still passes through the one process
    slow_v1 = simulate(_engine(gpu, FrontEnd(output_token_s=0.002)), burst)
    assert max(r.e2e for r in slow_v1) >= 80 * 0.002 > max(r.e2e for r in fast_out)


def test_a_v0_engine_detokenizes_in_its_own_loop_and_a_v1_api_server_in_its_process():
    gpu, fe = GPUS["h100-80gb"], FrontEnd(output_token_s=2e-5, chunk_s=3e-5)
    v0, v1 = _engine(gpu, fe, era="v0"), _engine(gpu, fe)
    assert v0.step_model.gpu.host_seq_s == pytest.approx(gpu.host_seq_s + 2e-5)  # a cost per sequence of each step
    assert (v0.front_end.output_token_s, v0.front_end.chunk_s) == (0.0, 3e-5)  # the server still writes the chunks
    assert v1.step_model.gpu.host_seq_s == gpu.host_seq_s and v1.front_end == fe


def _deliver(fe: FrontEnd, now: float, outputs: list) -> list:
    """A step's tokens handed to the API server at ``now``; the tokens whose time at the client is known by then."""
    fe.deliver(now, outputs)
    return fe.run(now)[1]


def test_a_v1_api_server_that_falls_behind_sends_the_tokens_that_waited_in_one_chunk_a_request():
    token, chunk = 1e-5, 1e-4
    fe = FrontEnd(output_token_s=token, chunk_s=chunk)
    # idle: a step's tokens are detokenized, then each request's stream sends its chunk
    assert _deliver(fe, 0.0, [("a", "a1"), ("b", "b1")]) == [("a1", pytest.approx(2 * token + chunk)),
                                                             ("b1", pytest.approx(2 * token + 2 * chunk))]
    # two more steps end while the process is busy: its next yield takes them both
    busy = 2 * (token + chunk)
    assert _deliver(fe, 1e-4, [("a", "a2"), ("b", "b2")]) == []
    assert _deliver(fe, 1.5e-4, [("a", "a3"), ("b", "b3")]) == []
    # the handler runs them back to back without yielding, so each request's two tokens leave in one chunk; the
    # step that ended after that yield waits for the next
    done = _deliver(fe, 3e-4, [("a", "a4")])
    assert done == [("a2", pytest.approx(busy + 4 * token + chunk)), ("a3", pytest.approx(busy + 4 * token + chunk)),
                    ("b2", pytest.approx(busy + 4 * token + 2 * chunk)),
                    ("b3", pytest.approx(busy + 4 * token + 2 * chunk))]
    assert fe.run(math.inf) == ([], [("a4", pytest.approx(busy + 5 * token + 3 * chunk))])
    assert not fe.pending
    # V0 sends every token in its own chunk, in the order the steps made them
    v0 = fe.reset(merge=False)
    _deliver(v0, 0.0, [("a", "a1"), ("b", "b1")])
    _deliver(v0, 1e-4, [("a", "a2"), ("b", "b2")])
    _deliver(v0, 1.5e-4, [("a", "a3"), ("b", "b3")])
    assert [t for t, _ in v0.run(math.inf)[1]] == ["a2", "b2", "a3", "b3"]
    assert v0.free_s == pytest.approx(6 * (token + chunk))


def test_a_step_of_more_requests_than_a_slice_streams_every_token_in_a_chunk_of_its_own():
    from autotune.sim.perf import OUTPUT_SLICE

    fe = FrontEnd(output_token_s=1e-5, chunk_s=1e-4)
    n = OUTPUT_SLICE + 72  # two slices a step, with a yield between them
    first = _deliver(fe, 0.0, [(r, (r, 1)) for r in range(n)])
    assert [tok for tok, _ in first] == [(r, 1) for r in range(n // 2)]  # the first slice goes out at the yield
    # the next step ends long before the process is done with this one
    assert _deliver(fe, 1e-3, [(r, (r, 2)) for r in range(n)]) == []
    sent = first + fe.run(math.inf)[1]
    assert sorted(tok for tok, _ in sent) == sorted((r, k) for r in range(n) for k in (1, 2))
    at = dict(sent)
    assert all(at[(r, 1)] < at[(r, 2)] for r in range(n))  # no request's two tokens shared a chunk
    assert fe.free_s == pytest.approx(2 * n * (1e-5 + 1e-4))


def test_a_burst_renders_in_full_before_its_first_request_reaches_the_engine():
    request, share, n = 0.01, 0.4, 10
    fe = FrontEnd(request_s=request, prompt_token_s=1e-5, render_share=share, latency_s=0.002)
    for i in range(n):
        fe.arrive(0.0, i, 100)
    admitted, _ = fe.run(math.inf)
    rest = request * (1 - share) + 100 * 1e-5
    assert [i for _, i in admitted] == list(range(n))  # first come, first admitted
    assert [t for t, _ in admitted] == [pytest.approx(n * request * share + k * rest + 0.002) for k in range(1, n + 1)]
    # a request that arrives on its own goes through both parts at once
    alone = FrontEnd(request_s=request, prompt_token_s=1e-5, render_share=share)
    alone.arrive(1.0, "x", 100)
    assert alone.run(math.inf)[0] == [(pytest.approx(1.0 + request + 100 * 1e-5), "x")]


def test_the_output_handler_takes_turns_with_the_admissions_of_a_burst():
    request, token, chunk = 0.01, 1e-4, 2e-4
    fe = FrontEnd(request_s=request, output_token_s=token, chunk_s=chunk, render_share=0.5)
    for i in range(10):
        fe.arrive(0.0, i, 0)
    # the whole burst is rendered (50 ms) before the first request reaches the engine, then one after another
    admitted, _ = fe.run(0.057)
    assert admitted == [(pytest.approx(0.055), 0), (pytest.approx(0.06), 1)]
    # the first request's token comes back while eight wait for their second part: the handler has the next turn
    fe.deliver(0.058, [(0, "tok")])
    admitted, sent = fe.run(0.0601)
    assert (admitted, sent) == ([], [("tok", pytest.approx(0.06 + token + chunk))])
    admitted, sent = fe.run(math.inf)
    assert admitted == [(pytest.approx(0.06 + token + chunk + k * 0.005), k + 1) for k in range(1, 9)]


def test_a_bursts_first_tokens_stream_while_the_rest_is_admitted_and_come_later_as_it_grows():
    # what bench/front_end_order.json measured on real vLLM: the burst's first token comes later the larger the
    # burst (every request is rendered first), and well before the last request's
    gpu, fe = GPUS["h100-80gb"], FrontEnd(request_s=2e-3, render_share=0.33, output_token_s=1e-5, chunk_s=3e-5)

    def first_tokens(n: int) -> list[float]:
        burst = Workload(tuple(Request(arrival_s=0.0, output_tokens=1, prompt_tokens=64) for _ in range(n)), "b")
        return [r.ttft for r in simulate(_engine(gpu, fe), burst)]

    small, large = first_tokens(100), first_tokens(400)
    assert min(large) - min(small) == pytest.approx(300 * 2e-3 * 0.33, rel=0.1)
    assert min(large) < 0.5 * max(large)
    assert max(large) >= 400 * 2e-3


def test_merged_chunks_lift_the_api_servers_ceiling_only_for_batches_of_one_slice():
    from autotune.sim.perf import OUTPUT_SLICE

    gpu = GPUS["h100-80gb"]
    fe = FrontEnd(output_token_s=1e-5, chunk_s=5e-4)
    ceiling = 1 / (fe.output_token_s + fe.chunk_s)  # tokens a second, one chunk each
    for n, lifted in ((OUTPUT_SLICE - 28, True), (OUTPUT_SLICE + 72, False)):
        burst = Workload(tuple(Request(arrival_s=0.0, output_tokens=64, prompt_tokens=100) for _ in range(n)), "b")
        v0 = summarize(simulate(_engine(gpu, fe, era="v0"), burst))
        v1 = summarize(simulate(_engine(gpu, fe), burst))
        engine_alone = summarize(simulate(_engine(gpu), burst))
        assert v0.output_throughput <= ceiling * 1.001
        assert v1.output_throughput < engine_alone.output_throughput
        if lifted:
            assert v1.output_throughput > 2 * ceiling, n
        else:
            assert v1.output_throughput <= ceiling * 1.001, n


def test_a_v0_engine_keeps_its_cuda_graphs_outside_the_kv_budget():
    from autotune.sim.startup import cudagraph_bytes, plan_startup

    gpu, shape = GPUS["a10-24gb"], model_shape("llama-3.1-8b")
    v1 = SimConfig.from_args({"max_model_len": 4096}, gpu, shape)
    v0 = replace(v1, era="v0")
    kv1, kv0 = (plan_startup(shape, gpu, c).plan.kv_cache for c in (v1, v0))
    assert kv0 - kv1 == cudagraph_bytes(shape, v1) > 0
    eager = replace(v1, enforce_eager=True)
    assert plan_startup(shape, gpu, replace(eager, era="v0")).plan.kv_cache == plan_startup(shape, gpu, eager).plan.kv_cache


@pytest.mark.parametrize("gpu, measured", [("h100-80gb", "gpu_microbench_h100.json"),
                                           ("h200-141gb", "gpu_microbench_h200.json")])
def test_the_measured_gpus_take_their_shares_from_the_microbenchmark(gpu, measured):
    """profiles.py's H100/H200 shares are what scripts/gpu_microbench.py measured, re-derived from its raw rows."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_microbench

    run = json.loads((ROOT / "bench" / measured).read_text())
    profile = GPUS[gpu]
    assert run["datasheet"] == {"bandwidth": profile.bandwidth, "bf16_flops": profile.bf16_flops}
    derived = gpu_microbench.derive(run, profile.bandwidth, profile.bf16_flops)
    assert derived == run["derived"]  # the stored summary is the raw rows' own
    for share in ("bandwidth_efficiency", "compute_efficiency", "attention_bandwidth_efficiency",
                  "attention_compute_efficiency"):
        assert getattr(profile, share) == derived[share], share


@pytest.mark.parametrize("gpu, measured", [("h100-80gb", "gpu_layer_h100.json"), ("h200-141gb", "gpu_layer_h200.json")])
def test_the_decode_layer_summary_is_its_raw_rows_own(gpu, measured):
    """bench/gpu_layer_*.json's ``derived`` (what --graph-measured runs the profiles with) re-derives from its rows."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_layer_bench

    run = json.loads((ROOT / "bench" / measured).read_text())
    assert run["gpu_profile"] == gpu
    assert gpu_layer_bench.derive(run, GPUS[gpu].bandwidth) == run["derived"]


def test_the_decode_layer_derivation_recovers_the_constants_it_was_built_from():
    """Rows made from a GEMM share, a KV share and a per-layer rest give those three back (the rest is what is
    left once the GEMMs and the KV reads are taken out); a TP-4 slice holds a quarter of a layer's weights."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_layer_bench

    bandwidth, gemm, kv, rest = 3e12, 0.8, 0.9, 20e-6
    decode, compiled = [], []
    for shape in ("llama-3-8b", "qwen3-32b"):
        weights, per_token = gpu_layer_bench.layer_bytes(shape)
        layer = weights / (bandwidth * gemm)
        for batch, context in ((1, 1024), (1, 32768), (32, 1024), (32, 4096)):
            kv_s = batch * context * per_token / (bandwidth * kv)
            decode.append({"model": shape, "batch": batch, "context": context, "kv": "contiguous",
                           "graph_s": layer + rest + kv_s})
        for batch in (1, 32):
            compiled.append({"model": shape, "batch": batch, "context": 1024, "gemms_graph_s": layer,
                             "compiled_graph_s": layer + rest + batch * 1024 * per_token / (bandwidth * kv)})
    derived = gpu_layer_bench.derive({"decode": decode, "compiled": compiled}, bandwidth)
    assert derived == {"graph_gemm_bandwidth_share": gemm, "kv_bandwidth_share": kv, "graph_layer_s": rest}
    assert gpu_layer_bench.layer_bytes("llama-3-70b:4")[0] * 4 == pytest.approx(
        gpu_layer_bench.layer_bytes("llama-3-70b")[0], rel=0.01)


def test_a_step_is_the_linear_layers_roofline_plus_attentions():
    """A chunk of prefill (its matmuls compute-bound) beside long decodes (their attention bound by KV reads):
    the two rooflines add up, each with its own shares; one roofline over all bytes and FLOPs would hide one."""
    from autotune.sim.perf import StepModel

    gpu = replace(GPUS["h100-80gb"], host_step_s=0.0, host_seq_s=0.0)
    shape = model_shape("llama-3.1-8b")
    model = StepModel(shape, gpu, SimConfig.from_args({"max_model_len": 32768}, gpu, shape))
    # 2048 new prompt tokens of one sequence + 64 decoding sequences at 16K context
    tokens, seqs, sampled, kv_tokens = 2048 + 64, 65, 64, 2048 + 64 * 16384
    attn = 2048 * (2048 + 1) / 2 + 64 * 16384
    kv = shape.kv_bytes_per_token(model.config.kv_cache_dtype, model.config.dtype)
    linear = max((shape.weights_bytes + tokens * kv) / (gpu.bandwidth * gpu.bandwidth_efficiency),
                 (tokens * 2 * shape.active_params + sampled * 2 * shape.hidden * shape.vocab)
                 / (gpu.bf16_flops * gpu.compute_efficiency * gpu.sustained_compute))
    attention = max(kv_tokens * kv / (gpu.bandwidth * gpu.attention_bandwidth_efficiency),
                    attn * 4 * shape.layers * shape.heads * shape.head_dim
                    / (gpu.bf16_flops * gpu.attention_compute_efficiency * gpu.sustained_compute))
    launch = 25e-6 * shape.layers  # a mixed batch: piecewise graphs
    assert model.seconds(tokens, seqs, sampled, attn, kv_tokens, False) == pytest.approx(linear + attention + launch)
    # the matmuls are compute-bound and the attention KV-bound here: neither term is negligible
    assert 0.2 < attention / (linear + attention) < 0.8
    slower_attention = StepModel(shape, replace(gpu, attention_bandwidth_efficiency=gpu.attention_bandwidth_efficiency / 2),
                                 model.config)
    assert slower_attention.seconds(tokens, seqs, sampled, attn, kv_tokens, False) > 1.3 * (linear + attention)


def test_the_public_moe_kernel_tables_run_against_the_simulators_layer(tmp_path):
    """Every table of bench/public_moe_kernels.toml names a GPU profile, a model with a shape and a dtype the
    simulator models; the script sets each measured row beside StepModel.moe_layer_seconds and gives the error
    per batch band."""
    import tomllib

    from autotune.sim.perf import StepModel

    script = ROOT / "scripts" / "bench_moe_kernels.py"
    out = tmp_path / "moe.json"
    r = subprocess.run([sys.executable, str(script), "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    tables = tomllib.loads((ROOT / "bench" / "public_moe_kernels.toml").read_text())["table"]
    assert [t["id"] for t in result["tables"]] == [t["id"] for t in tables]
    bands = [b for split in result["bands"].values() for b in split.values()]
    assert sum(b["rows"] for b in bands) == sum(len(t["times_us"]) for t in tables)
    assert {t["split"] for t in tables} == {"fit", "held-out"}
    # one row by hand: Qwen3-30B-A3B in fp8 on an H100 at 64 tokens
    table = next(t for t in tables if t["model"] == "Qwen/Qwen3-30B-A3B" and t["dtype"] == "fp8_w8a8")
    gpu, shape = GPUS["h100-80gb"], model_shape("Qwen/Qwen3-30B-A3B").served("fp8")
    expected = StepModel(shape, gpu, SimConfig.from_args({}, gpu, shape)).moe_layer_seconds(64) * 1e6
    row = next(r for r in result["tables"] if r["id"] == table["id"])["rows"]
    assert next(p for b, _, p in row if b == 64) == pytest.approx(expected)


def test_the_h100s_fused_moe_call_costs_are_what_the_fit_tables_give():
    """GpuProfile.moe_call_s, moe_expert_s and expert_bandwidth_efficiency of the H100 are `bench_moe_kernels.py
    --fit`'s result on the fit tables (rows of up to 128 tokens), which they then match within a few per cent."""
    import tomllib

    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_moe_kernels as b

    tables = tomllib.loads((ROOT / "bench" / "public_moe_kernels.toml").read_text())["table"]
    best, _ = b.fit_call_costs(tables)
    h100 = GPUS["h100-80gb"]
    assert best["moe_call_s"] == pytest.approx(h100.moe_call_s, rel=0.05)
    assert best["moe_expert_s"] == pytest.approx(h100.moe_expert_s, rel=0.05)
    assert best["expert_bandwidth_efficiency"] == pytest.approx(h100.expert_bandwidth_efficiency, rel=0.02)
    fit_rows = [(m, p) for t in tables if t["split"] == "fit" for n, m, p in b.predicted_us(t) if n <= b.FIT_MAX_TOKENS]
    assert len(fit_rows) >= 20 and b.mdape(fit_rows) < 0.05


def test_the_fits_leave_out_the_per_token_cells_of_answers_a_few_tokens_long():
    """A 4-token answer's TPOT is a burst's interleaving (GPUStack measured 208 ms and 17 ms for the same workload
    with and without async scheduling): the fits weigh its throughput and TTFT, not its TPOT or ITL; a longer
    answer's cells all count."""
    b = fidelity_script()
    cells = {"thr": (100.0, 110.0), "ttft_p50": (50.0, 40.0), "tpot_p50": (17.0, 130.0), "itl_p50": (150.0, 30.0)}
    short = {"workload": {"input_len": 128, "output_len": 4}}
    long = {"workload": {"input_len": 128, "output_len": 128}}
    sharegpt = {"workload": {"dataset": "sharegpt"}}  # lengths drawn per request: every cell counts
    rows = [b.Row(i, "h100-80gb", "m", "throughput", "fit", values=dict(cells)) for i in ("a", "b", "c")]
    metrics = ("thr", "tpot_p50", "itl_p50")
    assert list(b.fitted_cells([short], rows[:1], metrics)) == [cells["thr"]]
    assert list(b.fitted_cells([long, sharegpt], rows[1:], metrics)) == 2 * [cells[k] for k in metrics]


def test_the_served_engine_renders_a_burst_before_it_admits_it():
    """vllm-sim serve's engine (realtime.py) runs the API server's request side in the event loop's order too."""
    import asyncio

    from autotune.sim.exposition import SimMetrics
    from autotune.sim.realtime import RealtimeEngine, Stream
    from autotune.sim.scheduler import Request as EngineRequest

    request, share, n = 0.02, 0.5, 5
    engine = _engine(GPUS["h100-80gb"], FrontEnd(request_s=request, render_share=share))
    rt = RealtimeEngine(engine, SimMetrics("m", engine.config, engine.plan), log_stats=False)
    reached: dict[str, float] = {}

    async def burst() -> float:
        loop = asyncio.get_running_loop()
        rt.sched.add = lambda req: reached.setdefault(req.id, loop.time())  # type: ignore[method-assign]
        t0 = loop.time()
        for i in range(n):
            rt.add(Stream(EngineRequest(f"r{i}", 16, 1, t0), t0, 1, 1, 0))
        await asyncio.sleep(n * request + 0.2)
        return t0

    t0 = asyncio.run(burst())
    at = [reached[f"r{i}"] - t0 for i in range(n)]
    # every request rendered (n x 10 ms) before the first goes on, then one every 10 ms; real timers run late, never
    # early
    for k, t in enumerate(at, start=1):
        due = n * request * share + k * request * (1 - share)
        assert due <= t + 1e-3 < due + 0.05, (k, at)
