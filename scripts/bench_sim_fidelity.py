"""vllm-sim against public vLLM measurements: every point of bench/sim_calibration.toml, in virtual time.

    python scripts/bench_sim_fidelity.py [--split fit|held-out|all] [--points ID,...] [--json OUT] [--fit]

Each point's setup (GPU, model, TP, the engine flags the source states, the vLLM era's
defaults, input/output lengths, number of prompts, request rate or max concurrency) becomes
the workload and engine of ``vllm-sim predict`` (``autotune.sim.predict.predict``: the same
start-up plan, Scheduler, StepModel and client model), and the table sets what that predicts
beside what the source measured: output throughput, TTFT median/mean, TPOT median/mean, ITL
median (only where one chunk is one token), E2E (median; for offline latency points the
batch's latency), and the KV cache size for start-up points. Ratios are predicted/measured.
Each part (fit, held-out, as the ``split`` field of the set says, bench/sim_calibration.md)
ends with the median absolute percentage error per metric.

What each point's workload is:

- random data: every prompt the nominal input length; outputs the realised total spread
  evenly (the gpustack runs did not pass --ignore-eos, so the totals, not the nominal lengths);
- where the source saved each request's lengths (Lambda's result JSONs, copied to bench/public_lengths.json):
  those, in the source's order;
- ShareGPT otherwise: per-request lengths drawn from a log-normal (seeded, sigma 1.0), clamped as
  benchmark_serving.py filters ShareGPT (prompt <= 1024, prompt + output <= 2048, each >= 4)
  and scaled so the totals are the source's own "Total input/generated tokens" lines; the
  offline buildkite points report no totals and take the per-prompt means of the gpustack
  ShareGPT sample (217.4 in, 201.4 out);
- request rate inf: every request at t = 0; --max-concurrency as the client's cap; no warm-up.

Era switches (bench/sim_calibration.md, "V0 vs V1"): V1 (vLLM 0.11, gpustack) chunked prefill
and prefix caching on, no async scheduling (opt-in before 0.12), gpu_memory_utilization 0.9,
the API server's batching defaults; V0 (Lambda, issue #10517): no chunked prefill below a
32K context, no prefix caching, max_num_batched_tokens max(max_model_len, 2048), CUDA graphs
up to batch 256, graph memory outside the KV budget (``SimConfig.era``); offline (buildkite): the LLM class's batching defaults, no API server.

Points the simulator cannot model (a GPU without a profile, quantized weights) stay in the
table with the reason, and out of the error medians.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autotune.sim.config import SimConfig  # noqa: E402
from autotune.sim.perf import FrontEnd, weight_only  # noqa: E402
from autotune.sim.predict import PredictOptions, predict  # noqa: E402
from autotune.sim.profiles import GPUS, GpuProfile, model_shape  # noqa: E402
from autotune.sim.startup import GiB, plan_startup  # noqa: E402
from autotune.workload.trace import Request, Workload  # noqa: E402

CALIBRATION = ROOT / "bench" / "sim_calibration.toml"
GROUPS = ROOT / "bench" / "public_groups.toml"  # public per-config groups, every point held out (public_groups.md)
REGIMES = ("low-load", "kv-bound", "prefill-heavy", "short-burst", "throughput", "tp-scaling")
REGIME_METRICS = ("thr", "ttft_p50", "tpot_p50", "e2e")  # a regime's error: the median over these cells
KNOB_TARGETS = (1.15, 1.5)  # predicted best/worst ratio within 1.15x of the measured at the median, 1.5x at worst
# table columns: (key, header); the targets of issue 9 are on thr, ttft, tpot and e2e
METRICS = (("thr", "thr"), ("ttft_p50", "TTFT p50"), ("ttft_mean", "TTFT mean"), ("tpot_p50", "TPOT p50"),
           ("tpot_mean", "TPOT mean"), ("itl_p50", "ITL p50"), ("e2e", "E2E"), ("kv_gib", "KV GiB"))
TARGETS = {"thr": 0.15, "e2e": 0.15, "tpot_p50": 0.15, "ttft_p50": 0.25}
SHAREGPT_MEANS = (217393 / 1000, 201422 / 1000)  # gpustack's ShareGPT 1000-prompt totals, per prompt
# per-request lengths where the source saved them (Lambda's benchmark_serving.py JSONs), keyed by the point's source
LENGTHS = ROOT / "bench" / "public_lengths.json"
SHAREGPT_SIGMA = 1.0
# what-if (--sharegpt-shape lambda): a ShareGPT sample's shape as vLLM's own sampler drew it (benchmark_serving.py,
# seed 0, Llama-3 tokenizer) and Lambda saved it, 320 prompts, outputs as Llama-3-8B-Instruct ended them
SHAREGPT_SAMPLE = ("LambdaLabsML/vllm-benchmark@a4f9f4371a1ccac781293837fce2bce0cc6d25cc:"
                   "results/prompt_320/1xH100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp1_len2048.json")


@dataclass
class Row:
    id: str
    gpu: str
    model: str
    kind: str
    split: str
    regime: str = ""
    group: str = ""  # the public per-config group the point belongs to (bench/public_groups.toml), if any
    note: str = ""  # why the point is not modelled, or a caveat of the reproduction
    values: dict[str, tuple[float, float]] = field(default_factory=dict)  # metric -> (measured, predicted)
    kv_tokens: int | None = None  # the sim's KV pool, for the notes
    moe: bool = False  # a mixture-of-experts model

    @property
    def modelled(self) -> bool:
        return bool(self.values)

    def ape(self, metric: str) -> float | None:
        if metric not in self.values:
            return None
        m, p = self.values[metric]
        return abs(p - m) / m if m else None


def load_points(path: Path = CALIBRATION) -> list[dict[str, Any]]:
    return tomllib.loads(path.read_text())["point"]


def regime_of(point: dict[str, Any]) -> str:
    """The regime a point tests: the set's own ``regime`` where it names one, else from its kind and workload
    (long random prompts: prefill-heavy; short random prompts sent at once: a short-request burst)."""
    if point.get("regime"):
        return str(point["regime"])
    w = point["workload"]
    if point["kind"] == "low-load":
        return "low-load"
    if w.get("dataset") == "random" and int(w.get("input_len", 0)) >= 2000:
        return "prefill-heavy"
    if w.get("dataset") == "random" and int(w.get("input_len", 0)) <= 256:
        return "short-burst"
    return str(point["kind"])


def split_of(point: dict[str, Any]) -> str:
    return "held-out" if point["split"] == "heldout" else point["split"]


def sharegpt_lengths(n: int, total_in: int, total_out: int, seed: int = 0,
                     shape: str = "lognormal") -> list[tuple[int, int]]:
    """(prompt, output) lengths like a ShareGPT sample, clamped and scaled to the totals: each length log-normal
    (sigma 1.0), or ``shape="lambda"``: (prompt, output) pairs drawn from Lambda's sample (``SHAREGPT_SAMPLE``)."""
    rng = np.random.default_rng(seed)
    if shape == "lambda":
        pairs = np.array(saved_lengths(SHAREGPT_SAMPLE))
        a, b = pairs[rng.integers(0, len(pairs), n)].T.astype(float)
    else:
        a = rng.lognormal(0.0, SHAREGPT_SIGMA, n)
        b = rng.lognormal(0.0, SHAREGPT_SIGMA, n)
    ins, outs = a * total_in / a.sum(), b * total_out / b.sum()
    for _ in range(50):  # clamp as benchmark_serving.py filters ShareGPT, then rescale the rest
        ins = np.clip(ins, 4, 1024)
        outs = np.clip(outs, 4, np.maximum(4, 2048 - ins))
        ins *= total_in / ins.sum()
        outs *= total_out / outs.sum()
    pin = [max(4, int(round(x))) for x in ins]
    pout = [max(1, int(round(x))) for x in outs]
    return list(zip(pin, pout))


def published_lengths(point: dict[str, Any]) -> list[tuple[int, int]] | None:
    """The (prompt, output) lengths the point's source lists for each request (``saved_lengths``), or None."""
    return saved_lengths(str(point.get("source", "")))


@functools.cache
def _saved() -> dict[str, Any]:
    return json.loads(LENGTHS.read_text()) if LENGTHS.exists() else {}  # read once: a fit replays every point often


def saved_lengths(source: str) -> list[tuple[int, int]] | None:
    """The (prompt, output) lengths bench/public_lengths.json holds for ``source``, or None. An output of 0 is a
    request whose first token was the end of the text (benchmark_serving.py counts tokens of the text): the engine
    still generated that one token."""
    saved = _saved().get(source)
    if saved is None:
        return None
    return [(int(p), max(1, int(o))) for p, o in zip(saved["input_lens"], saved["output_lens"], strict=True)]


def _prompt(i: int, tokens: int) -> str:
    """Text the sim's codec counts as ``tokens`` tokens (~4 bytes each), unique per request (no prefix hits)."""
    head = f"{i:07d} "
    return (head + "lorem ipsum dolor sit amet " * (tokens // 6 + 2))[:4 * tokens].ljust(4 * tokens, ".")


def build_workload(point: dict[str, Any]) -> tuple[Workload, int | None]:
    """The point's requests and the client's max concurrency."""
    w = point["workload"]
    api = "chat" if w.get("endpoint") == "/v1/chat/completions" else "completion"
    if w["dataset"] == "random" and w.get("range_ratio"):
        # `vllm bench serve --random-range-ratio R`: each length uniform within +-R of the mean (seeded here; the
        # source's draws are not published). Fixed lengths would finish in lockstep at a concurrency limit, and
        # the next wave's prefills would queue behind each other
        n, r = int(w["num_prompts"]), float(w["range_ratio"])
        rng = np.random.default_rng(0)
        lengths = [(int(rng.uniform(1 - r, 1 + r) * w["input_len"]), int(rng.uniform(1 - r, 1 + r) * w["output_len"]))
                   for _ in range(n)]
    elif w["dataset"] == "random":
        n = int(w["num_prompts"])
        out_total = int(w.get("total_output_tokens", n * w["output_len"]))
        lengths = [(int(w["input_len"]), out_total // n + (1 if i < out_total % n else 0)) for i in range(n)]
    elif w["dataset"] == "offline-batch":
        lengths = [(int(w["input_len"]), int(w["output_len"]))] * int(w["batch_size"])
    elif published := published_lengths(point):
        lengths = published
    elif w["dataset"] == "sharegpt":
        n = int(w["num_prompts"])
        tin = w.get("total_input_tokens") or round(SHAREGPT_MEANS[0] * n)
        tout = w.get("total_output_tokens") or round(SHAREGPT_MEANS[1] * n)
        lengths = sharegpt_lengths(n, int(tin), int(tout), seed=0, shape=w.get("sharegpt_shape", "lognormal"))
    else:
        raise ValueError(f"{point['id']}: no workload for dataset {w['dataset']!r}")
    reqs = tuple(Request(arrival_s=0.0, output_tokens=o, prompt=_prompt(i, p), prompt_tokens=p, api=api)
                 for i, (p, o) in enumerate(lengths))
    return Workload(reqs, point["id"]), w.get("max_concurrency")


def engine_values(point: dict[str, Any], gpu: GpuProfile) -> dict[str, Any]:
    """The point's vLLM flags: the source's own, over its era's defaults (module docstring)."""
    args = dict(point.get("engine_args") or {})
    offline = point["workload"].get("dataset") == "offline-batch" or "benchmark_throughput" in str(
        point["workload"].get("benchmark", ""))
    v: dict[str, Any] = {"tensor_parallel_size": point.get("gpus", 1), "gpu_memory_utilization": 0.9,
                         "async_scheduling": False}
    if point["era"] == "v0":
        mml = int(args.get("max_model_len") or 8192)
        v.update(enable_chunked_prefill=mml >= 32768, enable_prefix_caching=False,
                 max_num_batched_tokens=None if mml >= 32768 else max(mml, 2048), max_num_seqs=256,
                 compilation_config={"max_cudagraph_capture_size": 256})
    elif offline:
        # the LLM class's defaults on a >= 70 GiB GPU other than an A100 (engine/arg_utils.py, 0.6-0.11)
        v.update(max_num_batched_tokens=16384, max_num_seqs=1024)
    v.update(args)
    return v


def _estimated_max_len(lines: tuple[str, ...]) -> int | None:
    for line in lines:
        if "estimated maximum model length is " in line:
            return int(line.split("estimated maximum model length is ")[1].split(".")[0])
    return None


def _unsupported(point: dict[str, Any]) -> str | None:
    from autotune.sim.config import not_modelled

    if point["gpu"] not in GPUS:
        return f"GPU {point['gpu']!r} has no vllm-sim profile"
    try:
        shape = model_shape(point["model"])
    except KeyError:
        return f"model {point['model']!r} has no shape"
    missing = not_modelled(shape, point.get("engine_args") or {}, model="the model")
    return f"not modelled: {missing}" if missing else None


def run_point(point: dict[str, Any], gpus: dict[str, GpuProfile] | None = None,
              front_end: FrontEnd | None = None, eras: bool = True) -> Row:
    """Predict one point; ``gpus`` and ``front_end`` override the simulator's own (a fit's candidates)."""
    row = Row(point["id"], point["gpu"], point["model"].split("/")[-1], point["kind"], split_of(point),
              regime_of(point), point.get("group", ""))
    why = _unsupported(point)
    if why:
        row.note = why
        return row
    gpu = (gpus or GPUS)[point["gpu"]]
    shape = model_shape(point["model"])
    row.moe = shape.experts > 0
    values = engine_values(point, gpu)
    config = SimConfig.from_args(values, gpu, shape)
    if eras and point["era"] == "v0":
        config = replace(config, era="v0")
    m = point["measured"]
    if point["kind"] == "startup":
        s = plan_startup(shape, gpu, config)
        pred_ok = s.plan is not None
        meas_ok = str(m.get("startup", "ok")).startswith("ok")
        # the start-up log's "Available KV cache memory" (also printed when the check after it fails)
        kv = next((float(line.split("memory: ")[1].split(" ")[0]) for ph in s.phases for line in ph.lines
                   if line.startswith("Available KV cache memory")), None)
        if s.plan is not None:
            kv = s.plan.kv_cache / GiB
        if kv is not None:
            row.values["kv_gib"] = (float(m["kv_cache_gib"]), kv)
        row.note = f"starts: measured {'yes' if meas_ok else 'no'}, predicted {'yes' if pred_ok else 'no'}"
        return row
    workload, conc = build_workload(point)
    offline = "batch_latency_median_ms" in m or "benchmark_throughput" in str(point["workload"].get("benchmark", ""))
    opts = PredictOptions(model=point["model"], served_name=point["model"], shape=shape, gpu=gpu,
                          gpu_key=point["gpu"], config=config, warmup=0, max_concurrency=conc,
                          api_server=not offline, front_end=front_end)
    p = predict(opts, workload)
    est = _estimated_max_len(p.failure_lines)
    if not p.started and est and "max_model_len" not in (point.get("engine_args") or {}):
        # the source started vLLM at the model's default context; the sim's memory estimate does
        # not (its activation/graph estimates leave less KV). Run at the longest context the sim
        # allows, and say so: the KV pool is then the sim's, which is what KV-bound points test.
        need = max(r.prompt_tokens or 0 for r in workload.requests) + max(r.output_tokens for r in workload.requests)
        if est >= need + 64:
            values["max_model_len"] = est
            config = replace(SimConfig.from_args(values, gpu, shape), era=config.era)
            p = predict(replace(opts, config=config), workload)
            row.note = f"sim refuses the default context; run at max_model_len {est}"
    if not p.started:
        f = p.outcome.failure
        text = (f.summary if f else "?").split(". ")[0]
        row.note = "; ".join(x for x in (row.note, f"predicted start-up failure: {text}") if x)
        return row
    s = p.outcome.steps[-1].summary
    ms = 1000.0

    def put(key: str, measured_key: str, predicted: float | None, scale: float = ms) -> None:
        if measured_key in m and predicted is not None:
            row.values[key] = (float(m[measured_key]), predicted * scale)

    put("thr", "output_throughput_tok_s", s.output_throughput, 1.0)
    put("thr", "request_throughput", s.request_throughput if "output_throughput_tok_s" not in m else None, 1.0)
    put("ttft_p50", "ttft_median_ms", s.ttft.p50)
    put("ttft_mean", "ttft_mean_ms", s.ttft.mean)
    put("tpot_p50", "tpot_median_ms", s.tpot.p50)
    put("tpot_mean", "tpot_mean_ms", s.tpot.mean)
    if point["source_id"] != "lambda-vllm-benchmark":  # Lambda's ITL is per ~10-token chunk
        # vllm bench serve times one gap per SSE chunk: the tokens a chunk carried after its first arrive with it
        gaps = [g for r in p.outcome.steps[-1].results for g in r.itl if g > 0]
        put("itl_p50", "itl_median_ms", float(np.median(gaps)) if gaps else None)
    put("e2e", "e2e_median_ms", s.e2e.p50)
    if "batch_latency_median_ms" in m:
        put("e2e", "batch_latency_median_ms", max(r.e2e or 0.0 for r in p.outcome.steps[-1].results))
    if point.get("quality") == "caveat":
        row.note = "; ".join(x for x in (row.note, "caveat (see the set)") if x)
    if point.get("what_if"):
        row.note = "; ".join(x for x in (row.note, "what-if: " + point["what_if"]) if x)
    row.kv_tokens = p.kv_cache_tokens
    return row


def run(points: list[dict[str, Any]], gpus: dict[str, GpuProfile] | None = None,
        front_end: FrontEnd | None = None, eras: bool = True) -> list[Row]:
    return [run_point(p, gpus, front_end, eras) for p in points]


# what-if (--graph-measured): the decode step as the lent GPUs measured it in CUDA graphs (scripts/gpu_layer_bench.py,
# bench/gpu_layer_*.json ``derived``), with the H100 host's share refitted on the fit part by
# `--graph-measured --fit-host h100-80gb` (~8 min); the H200 and H100 PCIe take the H100's host
GRAPH_MEASURED = {"h100-80gb": "h100", "h100-pcie-80gb": "h100", "h200-141gb": "h200"}
GRAPH_MEASURED_HOST = {"host_step_s": 471e-6, "host_seq_s": 0.0}


def graph_measured_gpus(host: bool = True) -> dict[str, GpuProfile]:
    """The profiles with the graph-replayed decode layer's measured shares (and, with ``host``, the refitted host)."""
    gpus = dict(GPUS)
    for name, file in GRAPH_MEASURED.items():
        derived = json.loads((ROOT / "bench" / f"gpu_layer_{file}.json").read_text())["derived"]
        gpus[name] = replace(GPUS[name], bandwidth_efficiency=derived["graph_gemm_bandwidth_share"],
                             attention_bandwidth_efficiency=derived["kv_bandwidth_share"],
                             graph_layer_s=derived["graph_layer_s"], **(GRAPH_MEASURED_HOST if host else {}))
    return gpus


def baseline_gpus() -> dict[str, GpuProfile]:
    """The profiles as they were before issue 9: one global 0.85/0.70, 8 us all-reduces, the round host costs."""
    return {k: replace(g, bandwidth_efficiency=0.85, compute_efficiency=0.70, allreduce_latency_s=8e-6,
                       attention_bandwidth_efficiency=None, attention_compute_efficiency=None,
                       host_step_s=1.2e-3, host_seq_s=4e-6) if g.platform == "cuda" else g
            for k, g in GPUS.items()}


def mdape(rows: list[Row], metric: str) -> float | None:
    errs = [e for r in rows if (e := r.ape(metric)) is not None]
    return statistics.median(errs) if errs else None


def _cell(row: Row, key: str) -> str:
    if key not in row.values:
        return "-"
    m, p = row.values[key]
    return f"{m:.4g}/{p:.4g} ({p / m:.2f}x)"


def table(rows: list[Row], title: str) -> str:
    head = ["point", "GPU", "model", "kind", *(h for _, h in METRICS), "note"]
    lines = [f"## {title} ({sum(r.modelled for r in rows)} of {len(rows)} points modelled; cells: measured/predicted"
             " (ratio); ms, tok/s (req/s for offline throughput), GiB)", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([r.id, r.gpu, r.model, r.kind, *(_cell(r, k) for k, _ in METRICS),
                                        r.note or ""]) + " |")
    lines.append("")
    lines.append(error_line(rows, title))
    return "\n".join(lines)


def error_line(rows: list[Row], title: str) -> str:
    errs = []
    for k, h in METRICS:
        e = mdape(rows, k)
        n = sum(k in r.values for r in rows)
        tgt = f", target {TARGETS[k]:.0%}" if k in TARGETS else ""
        errs.append(f"{h} {'-' if e is None else f'{e:.0%}'} (n={n}{tgt})")
    return f"median absolute error, {title}: " + "; ".join(errs)


def regime_errors(rows: list[Row]) -> dict[str, dict[str, Any]]:
    """Per regime, the held-out points' median absolute error over their REGIME_METRICS cells, and the worst cell;
    and the same median over the dense models' points and over the mixtures of experts' (``dense``, ``moe``:
    [points, median], or None where the regime has none)."""

    def cells_of(points: list[Row]) -> list[tuple[float, str, str]]:
        return [(e, r.id, k) for r in points for k in REGIME_METRICS if (e := r.ape(k)) is not None]

    out: dict[str, dict[str, Any]] = {}
    for regime in REGIMES:
        sel = [r for r in rows if r.regime == regime and r.split == "held-out" and r.modelled]
        cells = cells_of(sel)
        if cells:
            worst = max(cells)
            out[regime] = {"points": len(sel), "cells": len(cells),
                           "mdape": statistics.median(e for e, _, _ in cells), "worst": worst}
            for name, moe in (("dense", False), ("moe", True)):
                part = [r for r in sel if r.moe == moe]
                part_cells = cells_of(part)
                out[regime][name] = [len(part), statistics.median(e for e, _, _ in part_cells)] if part_cells else None
    return out


def regime_table(rows: list[Row]) -> str:
    lines = ["## held-out error per regime (median absolute error over each point's "
             f"{', '.join(REGIME_METRICS)} cells; target: no regime above 25 %)",
             "| regime | points | cells | median error | dense models (points) | mixtures of experts (points) "
             "| worst cell |", "|---|---|---|---|---|---|---|"]

    def part(p: list[float] | None) -> str:
        return "-" if p is None else f"{p[1]:.0%} ({p[0]})"

    for regime, e in regime_errors(rows).items():
        w = e["worst"]
        lines.append(f"| {regime} | {e['points']} | {e['cells']} | {e['mdape']:.0%} | {part(e['dense'])} "
                     f"| {part(e['moe'])} | {w[0]:.0%} ({w[1]}, {w[2]}) |")
    return "\n".join(lines)


def knob_effects(rows: list[Row]) -> list[dict[str, Any]]:
    """Per public group (bench/public_groups.toml): the ratio of its best config's throughput to its worst's,
    measured and predicted, Spearman of the predicted vs measured throughput, and where the predicted best
    config's measured throughput stands against the measured best (the regret of simulating first). A group
    with a point the simulator cannot express is listed with the reason."""
    from autotune.sim.fit import spearman

    groups: dict[str, list[Row]] = {}
    for r in rows:
        if r.group:
            groups.setdefault(r.group, []).append(r)
    out = []
    for name, rs in groups.items():
        g: dict[str, Any] = {"group": name, "configs": len(rs), "gpu": rs[0].gpu, "model": rs[0].model}
        missing = [r for r in rs if "thr" not in r.values]
        if missing:
            g["note"] = missing[0].note or "no throughput predicted"
            out.append(g)
            continue
        measured = [r.values["thr"][0] for r in rs]
        predicted = [r.values["thr"][1] for r in rs]
        g["measured_ratio"] = max(measured) / min(measured)
        g["predicted_ratio"] = max(predicted) / min(predicted)
        g["off_by"] = max(g["predicted_ratio"] / g["measured_ratio"], g["measured_ratio"] / g["predicted_ratio"])
        g["spearman"] = spearman(predicted, measured)
        g["first_pick_share"] = measured[predicted.index(max(predicted))] / max(measured)
        out.append(g)
    return out


def knob_table(rows: list[Row]) -> str:
    effects = knob_effects(rows)
    lines = [f"## knob effects: public per-config groups (best/worst throughput; target: within {KNOB_TARGETS[0]}x "
             f"at the median, {KNOB_TARGETS[1]}x at worst)",
             "| group | GPU | model | configs | measured best/worst | predicted | off by | Spearman | first pick "
             "(share of the measured best) | note |", "|---|---|---|---|---|---|---|---|---|---|"]
    for g in effects:
        if "off_by" in g:
            lines.append(f"| {g['group']} | {g['gpu']} | {g['model']} | {g['configs']} | {g['measured_ratio']:.2f} | "
                         f"{g['predicted_ratio']:.2f} | {g['off_by']:.2f}x | {g['spearman']:+.2f} | "
                         f"{g['first_pick_share']:.0%} | |")
        else:
            lines.append(f"| {g['group']} | {g['gpu']} | {g['model']} | {g['configs']} | | | | | | {g['note']} |")
    scored = [g["off_by"] for g in effects if "off_by" in g]
    if scored:
        lines.append("")
        lines.append(f"{len(scored)} of {len(effects)} groups expressible; knob effect off by "
                     f"{statistics.median(scored):.2f}x at the median, {max(scored):.2f}x at worst")
    return "\n".join(lines)


def summary_json(rows: list[Row]) -> dict[str, Any]:
    out: dict[str, Any] = {"points": [], "mdape": {}}
    for r in rows:
        out["points"].append({"id": r.id, "gpu": r.gpu, "model": r.model, "kind": r.kind, "split": r.split,
                              "note": r.note, "modelled": r.modelled,
                              "values": {k: {"measured": m, "predicted": p, "ratio": p / m if m else None}
                                         for k, (m, p) in r.values.items()}})
    for part in ("fit", "held-out", "all"):
        sel = [r for r in rows if part == "all" or r.split == part]
        out["mdape"][part] = {k: mdape(sel, k) for k, _ in METRICS}
    out["regimes"] = {k: {**v, "worst": list(v["worst"])} for k, v in regime_errors(rows).items()}
    out["knob_effects"] = knob_effects(rows)
    return out


FIT_METRICS = ("thr", "tpot_p50", "itl_p50", "e2e")  # TTFT is left to the front-end's constants
EFFICIENCY_BOUNDS = {"bandwidth_efficiency": (0.4, 1.0), "compute_efficiency": (0.2, 1.0)}
# measured by scripts/gpu_microbench.py (profiles.py): --fit leaves their shares alone
SHARES_MEASURED = {"h100-80gb", "h200-141gb"}
HOST_BOUNDS = {"host_step_s": (0.0, 5e-3), "host_seq_s": (0.0, 50e-6)}
ALLREDUCE_BOUNDS = {"allreduce_latency_s": (0.0, 60e-6)}
SUSTAINED_BOUNDS = {"sustained_compute": (0.2, 1.0)}
MOE_BOUNDS = {"grouped_gemm_share": (0.1, 1.0)}
WEIGHT_ONLY_BOUNDS = {"weight_only_share": (0.2, 1.0)}
SINK_ATTENTION_BOUNDS = {"sink_attention_share": (0.05, 1.0)}


# TPOT and ITL of answers a few tokens long are a burst's interleaving of prefills, not a step's time: GPUStack's
# gpt-oss-20b on an H100, 128 tokens in and 4 out, measured a median TPOT of 208 ms without async scheduling and 17 ms
# with it. The fits leave those cells out (the tables keep them); one of them otherwise outweighs a whole GPU's points.
SHORT_ANSWER_TOKENS = 4
PER_TOKEN_METRICS = ("tpot_p50", "tpot_mean", "itl_p50")


def fitted_cells(points: list[dict[str, Any]], rows: list[Row],
                 metrics: tuple[str, ...]) -> Iterator[tuple[float, float]]:
    """The (measured, predicted) pairs a fit's loss weighs: ``metrics`` of each row, less the per-token ones of
    answers of ``SHORT_ANSWER_TOKENS`` tokens or fewer."""
    for p, r in zip(points, rows, strict=True):
        short = p["workload"].get("output_len", SHORT_ANSWER_TOKENS + 1) <= SHORT_ANSWER_TOKENS
        yield from (r.values[k] for k in metrics if k in r.values and not (short and k in PER_TOKEN_METRICS))


def fit_profile(points: list[dict[str, Any]], gpu: str, bounds: dict[str, tuple[float, float]],
                metrics: tuple[str, ...] = FIT_METRICS, points_per_round: int = 5,
                rounds: int = 3, gpus: dict[str, GpuProfile] = GPUS) -> tuple[dict[str, float], float]:
    """Some of a GPU profile's constants (``bounds``' keys), fitted on ``points`` run on that GPU."""
    from autotune.sim.fit import fit, log_loss

    mine = [p for p in points if p["gpu"] == gpu and p["kind"] != "startup" and not _unsupported(p)]
    base = gpus[gpu]

    def loss(c: dict[str, float]) -> float:
        return log_loss(fitted_cells(mine, run(mine, {**gpus, gpu: replace(base, **c)}), metrics))

    return fit(loss, {k: getattr(base, k) for k in bounds}, bounds, points=points_per_round, rounds=rounds)


# the API server's per-request and per-token CPU costs are measured (scripts/bench_front_end.py, perf.API_SERVER):
# what is left to fit is how much faster a GPU host's core runs them, and the path outside that process (client,
# socket, the hop to the engine core)
FRONT_END_BOUNDS = {"latency_s": (0.0, 0.1), "host_speed": (0.5, 4.0)}
FRONT_END_METRICS = ("ttft_p50", "ttft_mean", "thr", "tpot_p50", "e2e")


def fit_front_end(points: list[dict[str, Any]], gpus: dict[str, GpuProfile] | None = None,
                  metrics: tuple[str, ...] = FRONT_END_METRICS, points_per_round: int = 5,
                  rounds: int = 3) -> tuple[dict[str, float], float]:
    """The API server's constants (perf.FrontEnd), fitted on ``points`` that went through it (V1 era)."""
    from autotune.sim.fit import fit, log_loss
    from autotune.sim.perf import API_SERVER, MEASURED_API_SERVER

    mine = [p for p in points if p["kind"] != "startup" and not _unsupported(p) and p["era"] == "v1"
            and p["workload"].get("endpoint")]

    def front_end(c: dict[str, float]) -> FrontEnd:
        m, speed = MEASURED_API_SERVER, c["host_speed"]
        return replace(m, request_s=m.request_s / speed, prompt_token_s=m.prompt_token_s / speed,
                       output_token_s=m.output_token_s / speed, chunk_s=m.chunk_s / speed, latency_s=c["latency_s"])

    def loss(c: dict[str, float]) -> float:
        return log_loss(fitted_cells(mine, run(mine, gpus, front_end(c)), metrics))

    start = {"latency_s": API_SERVER.latency_s, "host_speed": 1.0}
    return fit(loss, start, FRONT_END_BOUNDS, points=points_per_round, rounds=rounds)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--split", choices=("fit", "held-out", "all"), default="all")
    ap.add_argument("--points", help="comma-separated point ids (default: every point of the split)")
    ap.add_argument("--json", type=Path, help="write the rows and the error medians here")
    ap.add_argument("--calibration", type=Path, default=CALIBRATION)
    ap.add_argument("--groups", type=Path, default=GROUPS,
                    help="public per-config groups, all held out (default bench/public_groups.toml; '' for none)")
    ap.add_argument("--baseline", action="store_true",
                    help="the \"before\" figure: the pre-calibration constants (one global 0.85/0.70 efficiency, "
                         "8 us all-reduce, no API-server costs, no era switch)")
    ap.add_argument("--fit", action="store_true",
                    help="fit each GPU's bandwidth/compute fractions on the fit part and print them (no table)")
    ap.add_argument("--fit-allreduce", action="store_true",
                    help="fit each GPU's all-reduce latency on the fit part's tensor-parallel points and print it")
    ap.add_argument("--fit-host", metavar="GPU", action="append", default=[],
                    help="fit GPU's host share (host_step_s, host_seq_s) on the fit part's points on it and print it")
    ap.add_argument("--fit-sustained", metavar="GPU", action="append", default=[],
                    help="fit the share of GPU's measured compute rates a whole vLLM step sustains, on the fit part's "
                         "points on it (its prefill points decide it), and print it")
    ap.add_argument("--fit-moe", metavar="GPU", action="append", default=[],
                    help="fit the share of GPU's GEMM rate a MoE layer's grouped GEMMs reach, on the fit part's "
                         "mixture-of-experts points on it, and print it")
    ap.add_argument("--fit-weight-only", metavar="GPU", action="append", default=[],
                    help="fit the share of GPU's GEMM rate its linear layers reach with quantized weights computed in "
                         "bf16 (weight-only kernels), on the fit part's points of such models on it, and print it")
    ap.add_argument("--fit-sink-attention", metavar="GPU", action="append", default=[],
                    help="fit the share of GPU's attention compute rate vLLM's Triton attention reaches for attention "
                         "with sinks (gpt-oss), on the fit part's points of such models on it, and print it")
    ap.add_argument("--fit-front-end", action="store_true",
                    help="fit the API server's constants on the fit part's V1 serving points (short runs only) and print them")
    ap.add_argument("--gpu-as", metavar="PROFILE=OTHER", action="append", default=[],
                    help="what-if: run the points the set puts on PROFILE on OTHER instead (e.g. "
                         "h100-80gb=h100-pcie-80gb when a source does not say which variant); the notes say so")
    ap.add_argument("--graph-measured", action="store_true",
                    help="what-if: the H100's and H200's decode step as bench/gpu_layer_*.json measured it in CUDA "
                         "graphs, with the host refitted to it (bench/sim_fidelity.md, 'A whole decoder layer')")
    ap.add_argument("--sharegpt-shape", choices=("lognormal", "lambda"), default="lognormal",
                    help="the lengths of a ShareGPT point whose source lists none: log-normal, sigma 1.0 (default), "
                         "or what-if: pairs drawn from Lambda's published sample (bench/sim_fidelity.md)")
    a = ap.parse_args(argv)
    # fitting under --graph-measured starts from the measured shares and the shipped host (the refit's own start)
    gpus = graph_measured_gpus(host=not a.fit_host) if a.graph_measured else GPUS
    points = load_points(a.calibration) + (load_points(a.groups) if str(a.groups) not in ("", ".") else [])
    if a.points:
        wanted = [x.strip() for x in a.points.split(",") if x.strip()]
        unknown = sorted(set(wanted) - {p["id"] for p in points})
        if unknown:
            ap.error(f"unknown point ids: {', '.join(unknown)}")
        points = [p for p in points if p["id"] in wanted]
    swaps = dict(x.split("=", 1) for x in a.gpu_as)
    for k, v in swaps.items():
        if k not in GPUS or v not in GPUS:
            ap.error(f"--gpu-as {k}={v}: both must be vllm-sim GPU profiles ({', '.join(GPUS)})")
    points = [{**p, "gpu": swaps[p["gpu"]], "what_if": f"run as {swaps[p['gpu']]}"} if p["gpu"] in swaps else p
              for p in points]
    if a.sharegpt_shape != "lognormal":
        points = [{**p, "workload": {**p["workload"], "sharegpt_shape": a.sharegpt_shape}} for p in points]
    if a.split != "all":
        points = [p for p in points if split_of(p) == a.split]
    fit_part = [p for p in points if split_of(p) == "fit"]
    fits: list[tuple[str, list[dict[str, Any]], dict[str, tuple[float, float]]]] = []
    if a.fit:  # the GPUs whose shares nobody measured (profiles.py)
        fits += [(gpu, fit_part, EFFICIENCY_BOUNDS) for gpu in sorted(
            {p["gpu"] for p in fit_part if not _unsupported(p) and p["kind"] != "startup"} - SHARES_MEASURED)]
    if a.fit_allreduce:
        tp = [p for p in fit_part if p.get("gpus", 1) > 1]
        fits += [(gpu, tp, ALLREDUCE_BOUNDS) for gpu in sorted({p["gpu"] for p in tp if not _unsupported(p)})]
    for gpu in a.fit_host:
        if gpu not in GPUS:
            ap.error(f"--fit-host {gpu}: not a vllm-sim GPU profile ({', '.join(GPUS)})")
        fits.append((gpu, fit_part, HOST_BOUNDS))
    for gpu in a.fit_sustained:
        if gpu not in GPUS:
            ap.error(f"--fit-sustained {gpu}: not a vllm-sim GPU profile ({', '.join(GPUS)})")
        fits.append((gpu, fit_part, SUSTAINED_BOUNDS))
    for gpu in a.fit_moe:
        if gpu not in GPUS:
            ap.error(f"--fit-moe {gpu}: not a vllm-sim GPU profile ({', '.join(GPUS)})")
        fits.append((gpu, [p for p in fit_part if not _unsupported(p) and model_shape(p["model"]).experts], MOE_BOUNDS))
    for gpu in a.fit_weight_only:
        if gpu not in GPUS:
            ap.error(f"--fit-weight-only {gpu}: not a vllm-sim GPU profile ({', '.join(GPUS)})")
        fits.append((gpu, [p for p in fit_part if not _unsupported(p) and weight_only(
            model_shape(p["model"]).served((p.get("engine_args") or {}).get("quantization")), GPUS[gpu])],
                     WEIGHT_ONLY_BOUNDS))
    for gpu in a.fit_sink_attention:
        if gpu not in GPUS:
            ap.error(f"--fit-sink-attention {gpu}: not a vllm-sim GPU profile ({', '.join(GPUS)})")
        fits.append((gpu, [p for p in fit_part if not _unsupported(p) and model_shape(p["model"]).attention_sinks],
                     SINK_ATTENTION_BOUNDS))
    for gpu, part, bounds in fits:
        c, v = fit_profile(part, gpu, bounds, gpus=gpus)
        print(f"{gpu}: " + ", ".join(f"{k}={x:.3g}" for k, x in c.items()) + f" (log loss {v:.4f})", flush=True)
    if fits:
        return 0
    if a.fit_front_end:
        # the long KV-bound runs are left out for speed: their TTFT is the queue's, not the front-end's
        fit_part = [p for p in points if split_of(p) == "fit" and p["workload"].get("input_len", 0) < 1000]
        c, v = fit_front_end(fit_part)
        print(", ".join(f"{k}={x:.3g}" for k, x in c.items()) + f" (log loss {v:.4f})", flush=True)
        return 0
    if a.baseline:  # the simulator before issue 9's calibration: no front-end, no era switch
        rows = run(points, baseline_gpus(), FrontEnd(), eras=False)
    else:
        rows = run(points, gpus)
    for part in ("fit", "held-out"):
        # a group's points the simulator cannot express are listed below, its fit-part points are the set's own
        sel = [r for r in rows if r.split == part and (not r.group or (r.modelled and part == "held-out"))]
        if sel:
            print(table(sel, part))
            for moe in (True, False):
                family = [r for r in sel if r.moe == moe]
                if family and len(family) < len(sel):
                    print(error_line(family, f"{part}, {'mixture-of-experts' if moe else 'dense'} models"))
            print()
    print(regime_table(rows))
    print()
    print(knob_table(rows))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(summary_json(rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
