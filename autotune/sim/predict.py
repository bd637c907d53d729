"""``vllm-sim predict``: what ``autotune bench`` would measure, computed in virtual time.

    vllm-sim [--gpu NAME] predict MODEL [vLLM flags...] (--workload FILE | --scenario NAME --rate R) [...]

The engine is the one ``vllm-sim serve`` runs (the same start-up plan, Scheduler and
StepModel; cli.py parses both command lines with one parser), stepped by ``virtual.simulate``
instead of the wall clock. The client is the one ``autotune bench`` runs, modelled:

- the workload is autotune's (``workload.source.WorkloadSpec`` + ``load``, the same flags as
  ``autotune bench``), so a trace or a scenario means exactly what it means there;
- each request's prompt is the text the replay client would send (``replay.payload_for``:
  a completion's prefix and prompt, or a chat's messages through the sim's chat template),
  tokenized as the server tokenizes it, so prompt lengths and prefix-cache hits are the
  server's;
- output lengths are ``max_tokens`` with ``ignore_eos``, clamped to what the context leaves,
  as the server clamps them; ``--warmup`` requests (16 tokens each) run first, unmeasured;
  ``--load`` divides the arrival times; ``--max-concurrency`` holds requests back as the
  client's semaphore does.

The results are the replay client's RequestResult records, so ``measure.metrics.summarize``,
the SLO verdicts, ``console.print_result`` and ``Outcome.to_json`` apply unchanged: the same
table and the same JSON as ``autotune bench``, with ``"predicted": true``, the GPU and the
engine's flags instead of a process's argv and environment, and ``engine_start_s`` the
simulated start-up time. Latencies include the API server's own costs (perf.FrontEnd: a
fixed floor, per-request and per-token tokenization and detokenization in one serialized
process, fitted on public measurements); not modelled are the network beyond that floor and
``--stream-interval`` > 1 (ITL is per token).

A config that cannot start prints the start-up failure vLLM would print (the server's texts,
startup.py) and exits 1; ``--json`` then holds the failure and its class (``oom``,
``invalid-args``), classified by vLLM's failure patterns as the launcher classifies them.
"""

from __future__ import annotations

import io
import json
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from autotune.engine.failures import Failure, LogWatch, classify_exit
from autotune.engine.model import ModelShape, locate
from autotune.measure.metrics import RequestResult, summarize
from autotune.measure.session import Outcome, Step
from autotune.measure.slo import SLO
from autotune.measure.tables import outcome_tables
from autotune.sim.config import SimConfig
from autotune.sim.perf import API_SERVER, FrontEnd
from autotune.sim.profiles import GpuProfile
from autotune.sim.text import TextCodec, chat_prompt
from autotune.workload.options import WorkloadOptions
from autotune.workload.source import WorkloadSpec, load, read
from autotune.workload.trace import SKIPPED_WHY, Workload

__all__ = [
    "Prediction",
    "PredictOptions",
    "load_workload",
    "predict",
    "print_outcome",
    "prompt_ids",
    "report",
    "workload_spec",
    "write_json",
]

WARMUP_OUTPUT_TOKENS = 16  # the replay client's (ReplayOptions.warmup_output_tokens), as simulate() uses


@dataclass(frozen=True)
class PredictOptions:
    model: str  # MODEL as given
    served_name: str
    shape: ModelShape
    gpu: GpuProfile
    gpu_key: str  # the --gpu profile name
    config: SimConfig
    used_by_others: int = 0
    tokenizer: str | None = None  # tokenizer.json the server would count prompts with (None: ~4 bytes a token)
    load: float = 1.0
    max_concurrency: int | None = None
    warmup: int = 4
    slos: list[SLO] = field(default_factory=list)
    vllm_args: dict[str, Any] = field(default_factory=dict)  # the flags given, for the JSON
    api_server: bool = True  # requests pass through vLLM's API server (False: the offline LLM class)
    front_end: FrontEnd | None = None  # the API server's costs; None: perf.API_SERVER


@dataclass
class Prediction:
    outcome: Outcome
    options: PredictOptions
    failure_lines: tuple[str, ...] = ()  # vLLM's root cause, when the engine would not start
    validation_error: str | None = None  # vLLM's config error, when the flags are refused
    kv_cache_tokens: int | None = None

    @property
    def started(self) -> bool:
        return self.outcome.failure is None

    def to_json(self) -> dict[str, Any]:
        """``Outcome.to_json`` (``autotune bench --json``'s shape), less a process's url, argv and env."""
        d = self.outcome.to_json()
        for key in ("url", "argv", "env", "engine_stop_s"):
            d.pop(key, None)
        if d.get("warmup_s") is not None:
            d["warmup_s"] = None  # the warm-up's virtual time is not kept
        o = self.options
        return {
            "predicted": True,
            "gpu": o.gpu.name,
            "gpu_profile": o.gpu_key,
            "gpu_memory_bytes": o.gpu.memory_bytes,
            "engine_model": o.model,
            "vllm_args": o.vllm_args,
            "kv_cache_tokens": self.kv_cache_tokens,
            **d,
        }


def workload_spec(options: WorkloadOptions, model: str) -> WorkloadSpec:
    """The workload ``autotune bench`` would replay for these flags: ``--tokenizer`` builds the prompts,
    else MODEL's own tokenizer where vLLM would find the model (a directory with tokenizer.json); with
    neither, the prompts stay token counts (``load_workload``)."""
    return options.spec(options.tokenizer or locate(model).tokenizer)


def load_workload(spec: WorkloadSpec, model: str = "") -> Workload:
    """The workload to replay, and a note on stderr for what the reader left out or assumed.

    With a tokenizer it is ``workload.source.load``'s, prompts built as ``autotune bench`` builds them.
    Without one the simulator needs no text: a scenario's requests are their token counts and prefix
    groups (``workload.source.read``), which is what a built-in model name runs on; a model directory
    without tokenizer.json gets one note line saying so. A trace file's count is said on stderr.
    """
    if spec.tokenizer is None:
        workload = read(spec)
        if model and locate(model).directory is not None and not all(r.has_text for r in workload.requests):
            print(
                f"vllm-sim predict: note: {model} has no tokenizer.json: prompts are the workload's token "
                "counts (pass --tokenizer DIR to count them as the server would)",
                file=sys.stderr,
            )
    else:
        workload = load(spec)
    if spec.trace is not None:
        print(f"vllm-sim predict: note: {spec.trace}: replaying {len(workload)} requests", file=sys.stderr)
    if workload.skipped:
        print(
            f"vllm-sim predict: note: {spec.trace}: skipped {workload.skipped} conversations ({SKIPPED_WHY})",
            file=sys.stderr,
        )
    return workload


def prompt_ids(workload: Workload, codec: TextCodec) -> list[list[int]] | None:
    """Each request's prompt as the replay client sends it and the sim's server tokenizes it; None for a
    workload of token counts (the engine then takes each prompt's count and prefix group)."""
    from autotune.measure.replay import payload_for

    if not all(r.has_text for r in workload.requests):
        return None
    out = []
    for r in workload.requests:
        _, body = payload_for(r, "")
        out.append(codec.encode(chat_prompt(body["messages"]) if "messages" in body else body["prompt"]))
    return out


def _failure(lines: list[str], exit_code: int = 1) -> Failure:
    """The launcher's classification of what the engine printed (vLLM's failure patterns)."""
    from autotune.sim.kind import VllmSimKind

    watch = LogWatch(list(VllmSimKind.failure_patterns))
    for line in lines:
        watch.feed(line)
    return classify_exit(exit_code, watch)


def predict(opts: PredictOptions, workload: Workload) -> Prediction:
    """Start the simulated engine and replay ``workload`` on it in virtual time (see the module docstring)."""
    from autotune.sim.startup import plan_startup
    from autotune.sim.virtual import SimEngine, prompt_length, simulate

    out = Outcome(url=f"vllm-sim predict, {opts.gpu.name}", started_at=time.time())
    c = opts.config
    error = c.validate()
    if error is not None:
        from autotune.sim.server import print_validation_error

        text = io.StringIO()
        print_validation_error(error, text)
        out.failure = _failure(text.getvalue().splitlines())
        return Prediction(out, opts, validation_error=error)
    startup = plan_startup(opts.shape, opts.gpu, c, used_by_others=opts.used_by_others)
    if startup.failure or startup.plan is None:
        lines = startup.failure or ("RuntimeError: start-up failed",)
        out.failure = _failure(list(lines))
        out.engine_failed_after_s = startup.seconds
        return Prediction(out, opts, failure_lines=tuple(lines))
    out.engine_ready_s = startup.seconds
    front_end = (opts.front_end or API_SERVER) if opts.api_server else None
    engine = SimEngine(opts.shape, opts.gpu, c, startup.plan, front_end)
    if opts.load != 1.0:
        workload = workload.scaled(opts.load)
    ids = prompt_ids(workload, TextCodec(opts.tokenizer))
    mml = c.max_model_len
    lengths = [len(p) for p in ids] if ids is not None else [prompt_length(r) for r in workload.requests]
    # the server's get_max_tokens: max_tokens clamped to what the context leaves after the prompt
    workload = replace(
        workload,
        requests=tuple(
            replace(r, output_tokens=max(1, min(r.output_tokens, mml - n))) if n < mml else r
            for r, n in zip(workload.requests, lengths, strict=True)
        ),
    )
    results = simulate(
        engine, workload, warmup=opts.warmup, keep_itl=True, max_concurrency=opts.max_concurrency, prompt_ids=ids
    )
    _from_first_send(results)
    summary = summarize(results, opts.slos)
    measured = max((r.end_s for r in results), default=0.0)
    out.steps.append(
        Step(
            opts.load,
            workload.rate,
            summary,
            summary.verdicts(opts.slos),
            measured,
            results,
            opts.served_name,
            0.0,
            measured,
        )
    )
    return Prediction(out, opts, kv_cache_tokens=startup.plan.kv_tokens)


def _from_first_send(results: list[RequestResult]) -> None:
    """Times from the first request's arrival, as the replay client schedules them (arrival 0 is its start)."""
    if not results:
        return
    t0 = min(r.scheduled_s for r in results)
    for r in results:
        r.scheduled_s -= t0
        r.sent_s -= t0


def print_failure(p: Prediction) -> None:
    """What vLLM would print: its config error, or the engine core's root cause (the server's texts)."""
    from autotune.sim.server import print_startup_failure, print_validation_error

    if p.validation_error is not None:
        print_validation_error(p.validation_error)
    else:
        print_startup_failure(p.failure_lines)


def write_json(p: Prediction, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(p.to_json(), indent=2) + "\n")


def write_requests(p: Prediction, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in p.outcome.requests_json()))


def print_outcome(out: Outcome) -> None:
    """``autotune bench``'s result tables (measure/tables.py, which console.py prints too), for a predicted outcome."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console.width = 200  # a pipe: tables as wide as their content, as console.py does
    start = "-" if out.engine_ready_s is None else f"{out.engine_ready_s:.1f} s (simulated)"
    for table in outcome_tables(out, start):
        console.print(table)


def report(p: Prediction, json_path: Path | None, requests_path: Path | None) -> int:
    """Print and write the prediction; the exit code (0 started and every SLO holds, 1 otherwise)."""
    if not p.started:
        print_failure(p)
        f = p.outcome.failure
        assert f is not None
        print(
            f"vllm-sim predict: the engine would not start ({f.failure_class.value}): {f.summary}",
            file=sys.stderr,
            flush=True,
        )
    else:
        print_outcome(p.outcome)
    if json_path is not None:
        write_json(p, json_path)
    if requests_path is not None and p.started:
        write_requests(p, requests_path)
    return 0 if p.outcome.slos_hold else 1
