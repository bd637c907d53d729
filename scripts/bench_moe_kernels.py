"""vllm-sim's fused-MoE layer against vLLM's own kernel timings: every table of bench/public_moe_kernels.toml.

    python scripts/bench_moe_kernels.py [--json OUT] [--fit | --fit-fp8-grouped]

Each table is a public run of vLLM's benchmarks/kernels/benchmark_moe.py (or sglang's copy of it): one fused-MoE
call (routing, the two grouped GEMMs, the activation) timed on a named GPU for batch sizes 1 to a few thousand
tokens, the model's experts at tensor-parallel size ``tp`` in ``dtype`` (bf16, or fp8_w8a8 on fp8 tensor cores).
The simulator's figure for the same call is ``StepModel.moe_layer_seconds``: a fixed cost, plus the experts
touched read from memory or their GEMMs (each expert's rows padded to the kernel's row block) at the profile's
``grouped_gemm_share``, whichever is longer, plus the routed tokens' hidden vectors gathered, written and summed
(``routed_activation_seconds``). Ratios are
predicted/measured; each table ends with the median absolute error, and the summary gives it per batch band
(1-8 tokens, 16-128, 256 and more), where different costs dominate (the call's fixed cost, the experts' reads,
the GEMMs) and per split.

``--fit`` fits the H100 profile's call costs (``MOE_CALL_BOUNDS``) on the rows of up to ``FIT_MAX_TOKENS`` tokens of
the tables marked ``split = "fit"``, where the reads bind; ``--fit-fp8-grouped`` fits its ``fp8_grouped_gemm_share``
on the fit tables' fp8 rows above that, where the GEMMs bind; the other tables are held out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tomllib
from dataclasses import replace
from pathlib import Path
from collections.abc import Callable
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autotune.engine.model import ModelShape  # noqa: E402
from autotune.sim.config import SimConfig  # noqa: E402
from autotune.sim.perf import StepModel  # noqa: E402
from autotune.sim.profiles import GPUS, GpuProfile, model_shape  # noqa: E402

TABLES = ROOT / "bench" / "public_moe_kernels.toml"
BANDS = (("1-8", 1, 8), ("16-128", 16, 128), (">=256", 256, 1 << 30))
FIT_GPU = "h100-80gb"
# above it the GEMMs bind: their share is fitted on serving points (bench_sim_fidelity --fit-moe), fp8's on these tables
FIT_MAX_TOKENS = 128
MOE_CALL_BOUNDS = {"moe_call_s": (0.0, 60e-6), "moe_expert_s": (0.0, 2e-6), "expert_bandwidth_efficiency": (0.4, 1.0)}


def served(shape: ModelShape, dtype: str) -> ModelShape:
    """The experts as the benchmark builds them: bf16 (the checkpoint's own quantization dropped), or fp8."""
    if dtype == "fp8_w8a8":
        return shape if shape.weight_quant == "fp8" else replace(shape, weight_quant="").served("fp8")
    if dtype in ("auto", "bf16", "bfloat16"):
        return replace(shape, weight_quant="", dtype="bfloat16")
    raise ValueError(f"dtype {dtype!r}: not one the simulator models (bf16, fp8_w8a8)")


def predicted_us(table: dict[str, Any], gpus: dict[str, GpuProfile] = GPUS) -> list[tuple[int, float, float]]:
    """(batch, measured us, predicted us) for each row of ``table``."""
    gpu = gpus[table["gpu"]]
    shape = served(model_shape(table["model"]), table["dtype"])
    model = StepModel(shape, gpu, SimConfig.from_args({"tensor_parallel_size": table.get("tp", 1)}, gpu, shape))
    return [(int(b), float(us), model.moe_layer_seconds(int(b)) * 1e6) for b, us in table["times_us"]]


def mdape(pairs: list[tuple[float, float]]) -> float:
    return statistics.median(abs(p / m - 1) for m, p in pairs) if pairs else float("nan")


def _fit_h100(tables: list[dict[str, Any]], start: dict[str, float], bounds: dict[str, tuple[float, float]],
              keep: Callable[[dict[str, Any], int], bool]) -> tuple[dict[str, float], float]:
    """``start``'s constants of the H100 profile fitted (log loss) on the fit tables' rows ``keep(table, batch)``."""
    from autotune.sim.fit import fit, log_loss

    mine = [t for t in tables if t.get("split") == "fit" and t["gpu"] == FIT_GPU]
    base = GPUS[FIT_GPU]

    def loss(c: dict[str, float]) -> float:
        gpus = {**GPUS, FIT_GPU: replace(base, **c)}
        return log_loss((m, p) for t in mine for b, m, p in predicted_us(t, gpus) if keep(t, b))

    return fit(loss, start, bounds, points=9, rounds=6)


def fit_call_costs(tables: list[dict[str, Any]]) -> tuple[dict[str, float], float]:
    """The H100's fused-MoE call costs fitted on the fit tables' rows where the reads bind (log loss)."""
    base = GPUS[FIT_GPU]
    start = {"moe_call_s": base.moe_call_s, "moe_expert_s": base.moe_expert_s,
             "expert_bandwidth_efficiency": base.expert_bandwidth_efficiency or base.bandwidth_efficiency}
    return _fit_h100(tables, start, MOE_CALL_BOUNDS, lambda t, b: b <= FIT_MAX_TOKENS)


def fit_fp8_grouped_share(tables: list[dict[str, Any]]) -> tuple[dict[str, float], float]:
    """The H100's share of the fp8 rate that Triton's W8A8 fused MoE reaches in its grouped GEMMs, fitted on the fit
    tables' fp8 rows above ``FIT_MAX_TOKENS`` tokens, where the GEMMs bind (log loss)."""
    base = GPUS[FIT_GPU]
    start = {"fp8_grouped_gemm_share": base.fp8_grouped_gemm_share or base.grouped_gemm_share}
    return _fit_h100(tables, start, {"fp8_grouped_gemm_share": (0.05, 1.0)},
                     lambda t, b: t["dtype"] == "fp8_w8a8" and b > FIT_MAX_TOKENS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tables", type=Path, default=TABLES)
    ap.add_argument("--json", type=Path, help="write every row and the medians here")
    ap.add_argument("--fit", action="store_true", help=f"fit {FIT_GPU}'s fused-MoE call costs on the fit tables")
    ap.add_argument("--fit-fp8-grouped", action="store_true",
                    help=f"fit {FIT_GPU}'s fp8 grouped-GEMM share on the fit tables' fp8 rows where the GEMMs bind")
    a = ap.parse_args(argv)
    tables = tomllib.loads(a.tables.read_text())["table"]
    if a.fit or a.fit_fp8_grouped:
        best, loss = fit_call_costs(tables) if a.fit else fit_fp8_grouped_share(tables)
        print(f"{FIT_GPU}: " + ", ".join(f"{k}={v:.4g}" for k, v in best.items()) + f" (log loss {loss:.4f})")
        return 0
    out: dict[str, Any] = {"tables": [], "bands": {}}
    everything: list[tuple[str, int, float, float]] = []
    for t in tables:
        rows = predicted_us(t)
        everything += [(t["split"], *r) for r in rows]
        print(f"## {t['id']} ({t['gpu']}, {t['model']}, {t['dtype']}, TP {t.get('tp', 1)}, {t['config']})")
        print("| batch | measured us | predicted us | ratio |\n|---|---|---|---|")
        for b, m, p in rows:
            print(f"| {b} | {m:.1f} | {p:.1f} | {p / m:.2f}x |")
        err = mdape([(m, p) for _, m, p in rows])
        print(f"median absolute error {err:.0%}\n")
        out["tables"].append({"id": t["id"], "split": t["split"], "mdape": err, "rows": [list(r) for r in rows]})
    print("| tables | batch band | rows | median absolute error | median ratio |\n|---|---|---|---|---|")
    for split in ("fit", "held-out"):
        for name, lo, hi in BANDS:
            band = [(m, p) for sp, b, m, p in everything if sp == split and lo <= b <= hi]
            err, ratio = mdape(band), statistics.median(p / m for m, p in band) if band else float("nan")
            print(f"| {split} | {name} | {len(band)} | {err:.0%} | {ratio:.2f}x |")
            out["bands"].setdefault(split, {})[name] = {"rows": len(band), "mdape": err, "median_ratio": ratio}
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
