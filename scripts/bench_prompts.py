#!/usr/bin/env python3
"""How long does building a workload's prompts take? The shipped scenarios at --requests requests each.

    .venv/bin/python scripts/bench_prompts.py [--tokenizer DIR] [--requests 5000]

For each scenario: the builder's one-off set-up, then materialize() over the workload, in ms per prompt; then
every prompt is re-encoded (not timed) to check that its length is exactly what the workload asked for.
Without --tokenizer the tiny model's (scripts/build_tiny_model.py) is built under a temporary directory.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from autotune.workload.prompts import PromptBuilder, load_tokenizer, materialize
from autotune.workload.synth import SCENARIOS, synthesize


def exact(builder: PromptBuilder, workload) -> int:
    """How many prompts are not the length their request asked for."""
    tok, newline = builder.tok, len(builder.tok.encode("\n"))
    wrong = 0
    for r in workload.requests:
        own = r.prompt_tokens - r.prefix_tokens
        if r.prefix is None:
            wrong += tok.count(r.prompt) != own
        else:
            wrong += tok.count(r.prefix) != r.prefix_tokens
            wrong += tok.count(r.prefix + "\n" + r.prompt) != r.prompt_tokens + newline
    return wrong


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, help="a model directory or tokenizer.json (default: the tiny model)")
    ap.add_argument("--requests", type=int, default=5000)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = a.tokenizer
        if path is None:
            path = Path(tmp) / "tiny-llama"
            script = Path(__file__).with_name("build_tiny_model.py")
            subprocess.run([sys.executable, str(script), str(path)], check=True, stdout=subprocess.DEVNULL)
        tokenizer = load_tokenizer(path)
        t = time.perf_counter()
        builder = PromptBuilder(tokenizer)
        setup_s = time.perf_counter() - t
        print(f"tokenizer {path}: {len(tokenizer.vocab)} tokens; builder set-up {setup_s * 1000:.0f} ms "
              f"(joins words exactly: {getattr(builder, 'joins_exactly', '-')})")
        print(f"{'scenario':<18}{'requests':>9}{'tokens/prompt':>15}{'ms/prompt':>11}{'wrong lengths':>15}")
        for name in SCENARIOS:
            w = synthesize(name, rate=10.0, num_requests=a.requests, seed=0)
            t = time.perf_counter()
            m = materialize(w, builder)
            per_prompt = (time.perf_counter() - t) / len(w) * 1000
            mean_tokens = sum(r.prompt_tokens for r in w.requests) / len(w)
            print(f"{name:<18}{len(w):>9}{mean_tokens:>15.0f}{per_prompt:>11.3f}{exact(builder, m):>15}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
