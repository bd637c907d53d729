"""The ``vllm-sim`` command: ``vllm serve`` for a GPU that is not there.

    vllm-sim [--gpu NAME [--gpu-total-memory BYTES]] [--time-scale F] [--gpu-memory-used-by-others BYTES]
             serve MODEL [vLLM flags...]

The command line is vLLM 0.33's: the parser is built from the bundled flag table
(``engine.vllm.flags.bundled_table("0.33")``), so every flag a real ``vllm serve`` accepts is
accepted (boolean flags with their ``--no-`` forms and their ``--enable-``/``--disable-``
twins), anything else is argparse's usage error (``error: unrecognized arguments: --foo``,
exit 2), underscores may stand for dashes, and ``--config FILE.yaml`` is spliced in the way
vLLM's FlexibleArgumentParser does it (after the model, before the other flags: the command
line wins). Only the flags ``SimConfig`` reads change the simulation; the rest are accepted
and ignored. The sim's own options (``--gpu``, ``--time-scale``, ``--gpu-memory-used-by-others``)
may come before or after ``serve``; ``--gpu-total-memory`` makes the profile's card one of another
memory size (an H100 64GB is ``--gpu h100-80gb --gpu-total-memory 64GiB``).

MODEL is a named profile (llama-3.1-8b, qwen3-32b, ...: ``sim.profiles.MODELS``), a Hugging Face id
of one of them, or a directory with config.json (and tokenizer.json, used to count prompts).

    vllm-sim [--gpu NAME] [--gpu-memory-used-by-others BYTES] predict MODEL [vLLM flags...]
             (--workload FILE | --scenario NAME --rate R [--requests N] [--prompt-tokens N|LO-HI]
              [--output-tokens N|LO-HI] [--prefix-tokens N|LO-HI] [--burstiness B] [--api chat|completion])
             [--load F] [--max-concurrency N] [--warmup N] [--slo SLO]... [--json OUT] [--requests-json OUT]

``predict`` runs the engine ``serve`` would start on the workload ``autotune bench`` would
replay, in virtual time (a fraction of a second; predict.py has the details), and prints
what ``autotune bench`` prints: request, output and total token throughput, goodput, and
TTFT/TPOT/ITL/E2E mean and percentiles; ``--json OUT`` writes ``autotune bench --json``'s
shape with ``"predicted": true``, the GPU and the engine's flags (``--time-scale`` does
nothing there: nothing runs in real time). The vLLM flags are parsed
by the same parser as ``serve``'s; the workload flags are ``autotune bench``'s and mean what
they mean there, except two that are vLLM's flags too: ``--tokenizer DIR`` builds and counts
the prompts (default: MODEL when it is a directory), and ``--seed`` seeds the workload (vLLM's
sampling seed changes nothing here: the replay sends ``ignore_eos``). A config that cannot
start prints vLLM's start-up failure (its config error, or the engine core's root cause) and
exits 1, ``--json`` then holding the failure and its class (``oom``, ``invalid-args``). Exit
codes: 0 the engine starts and every ``--slo`` holds; 1 it would not start, or an SLO misses;
2 bad usage (one line on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from autotune.engine.flags import Flag, dest_of
from autotune.engine.model import parse_bytes
from autotune.engine.vllm.flags import bundled_table
from autotune.sim.kind import SIMULATED_VLLM

__all__ = ["build_parser", "main", "parse"]

SIM_OPTIONS = {
    "--gpu": "gpu",
    "--gpu-total-memory": "gpu_total_memory",
    "--time-scale": "time_scale",
    "--gpu-memory-used-by-others": "gpu_memory_used_by_others",
}
USAGE = (
    "vllm-sim [--gpu NAME] [--gpu-total-memory BYTES] [--time-scale F] [--gpu-memory-used-by-others BYTES] "
    "serve MODEL [vLLM flags...]"
)
PREDICT_USAGE = (
    "vllm-sim [--gpu NAME] predict MODEL [vLLM flags...] (--workload FILE | --scenario NAME --rate R) "
    "[--max-concurrency N] [--json OUT]"
)
COMMANDS = ("serve", "predict")
HOST_DEFAULT, PORT_DEFAULT = "127.0.0.1", 8000
# vLLM's human_readable_int flags (engine/arg_utils.py): 8k = 8000, 8K = 8192
HUMAN_READABLE_INTS = {
    "max_num_batched_tokens",
    "max_num_scheduled_tokens",
    "kv_cache_memory_bytes",
    "safetensors_prefetch_block_size",
    "max_num_queued_tokens",
}


def _json_arg(value: str) -> Any:
    """vLLM's JSON flags take a JSON object; other spellings (``-cc 3``) pass through as text."""
    return json.loads(value) if value.lstrip().startswith("{") else value


def _human_int(value: str) -> int:
    """vLLM's human-readable ints for --max-model-len: 32k = 32000, 32K = 32768; -1 or auto = fit to memory."""
    if value.strip().lower() in ("-1", "auto"):
        return -1
    return parse_bytes(value)


class _Bool(argparse.Action):
    """--x / --no-x, and vLLM's inverted twins (--enable-prefix-caching / --disable-prefix-caching)."""

    def __init__(self, option_strings: Sequence[str], dest: str, flag_name: str = "", **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=None, **kw)
        self.flag_name = flag_name

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, _bool_value(self.flag_name, option_string or self.flag_name))


def _bool_value(name: str, spelling: str) -> bool:
    if spelling.startswith("--no-"):
        return False
    for a, b in (("--enable-", "--disable-"), ("--disable-", "--enable-")):
        if name.startswith(a) and spelling.startswith(b):
            return False
    return True


class _Parser(argparse.ArgumentParser):
    one_line = False  # predict's usage errors: one line; serve keeps argparse's usage line (vLLM's format)

    def error(self, message: str) -> NoReturn:  # argparse's own format: the launcher's classifier reads it
        if self.one_line:
            self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _add_flag(group: argparse._ArgumentGroup, flag: Flag) -> None:
    dest = dest_of(flag.name)
    spellings = [flag.name, *flag.aliases]
    if flag.kind == "bool":
        group.add_argument(*spellings, "--no-" + flag.name[2:], dest=dest, action=_Bool, flag_name=flag.name)
        return
    if flag.kind == "switch":
        group.add_argument(*spellings, dest=dest, action="store_const", const=True, default=None)
        return
    kw: dict[str, Any] = {"dest": dest, "default": None}
    conv: Any = {"int": int, "float": float, "json": _json_arg}.get(flag.type, str)
    if dest == "max_model_len":
        conv = _human_int
    elif dest in HUMAN_READABLE_INTS:
        conv = parse_bytes
    elif dest == "host":
        kw["default"] = HOST_DEFAULT  # the brief: bind localhost unless told (vLLM binds every interface)
    elif dest == "port":
        kw["default"] = PORT_DEFAULT
    elif dest == "served_model_name":
        kw["nargs"] = "+"
    kw["type"] = conv
    if flag.choices:
        with contextlib.suppress(ValueError, TypeError):  # choices the type cannot read: left unchecked
            kw["choices"] = [conv(c) for c in flag.choices]
    group.add_argument(*spellings, **kw)


def build_parser(command: str = "serve") -> argparse.ArgumentParser:
    from autotune.sim.profiles import GPUS

    if command == "predict":
        p = _Parser(
            prog="vllm-sim predict",
            usage=PREDICT_USAGE,
            allow_abbrev=False,
            description="What autotune bench would measure on vllm-sim's engine, computed in virtual time.",
        )
        p.one_line = True
    else:
        p = _Parser(
            prog="vllm-sim serve",
            usage=USAGE,
            allow_abbrev=False,
            description="vllm serve, simulated: vLLM 0.33's API, start-up and scheduling on a simulated GPU.",
        )
    p.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="a named model, a Hugging Face id we know, or a directory with config.json",
    )
    sim = p.add_argument_group("vllm-sim")
    sim.add_argument("--gpu", default="h100-80gb", choices=sorted(GPUS), help="the simulated GPU (default h100-80gb)")
    sim.add_argument(
        "--gpu-total-memory",
        type=parse_bytes,
        metavar="BYTES",
        help="the GPU's total memory where it differs from the profile's (an H100 64GB: --gpu h100-80gb "
        "--gpu-total-memory 64GiB)",
    )
    sim.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiplies the start-up phases' durations (tests: 0.01); serving runs in real time",
    )
    sim.add_argument(
        "--gpu-memory-used-by-others",
        type=parse_bytes,
        default=0,
        metavar="BYTES",
        help="GPU memory other processes hold (default 0)",
    )
    eng = p.add_argument_group("vLLM 0.33 engine and server flags")
    seen: set[str] = set()
    for flag in bundled_table(SIMULATED_VLLM).flags.values():
        if flag.name not in seen:
            seen.add(flag.name)
            _add_flag(eng, flag)
    if command == "predict":
        _add_predict_options(p)
    return p


def _add_predict_options(p: argparse.ArgumentParser) -> None:
    """``autotune bench``'s workload and replay flags (workload/options.py), less the two vLLM has (--seed,
    --tokenizer) and --request-timeout (nothing runs in real time); its SLOs and its JSON outputs."""
    from autotune.workload.options import add_arguments

    r = add_arguments(
        p,
        workload_title="workload (as autotune bench: a trace file or a synthetic scenario)",
        replay_title="replay (as autotune bench), in virtual time",
        seed_and_tokenizer=False,
        request_timeout=False,
    )
    r.add_argument(
        "--slo",
        action="append",
        default=[],
        help="an SLO, repeatable, as autotune bench takes it: 'ttft<800ms' (p95), 'p99:tpot<50ms', ...",
    )
    r.add_argument("--json", type=Path, help="write the result as JSON here (autotune bench --json's shape)")
    r.add_argument("--requests-json", type=Path, help="write every request's timings (JSONL) here")


def _normalize(args: list[str]) -> list[str]:
    """vLLM's FlexibleArgumentParser spellings: --max_num_seqs is --max-num-seqs, -O3 is --optimization-level 3."""
    out: list[str] = []
    for a in args:
        if a.startswith("--"):
            key, eq, value = a.partition("=")
            head, dot, tail = key.partition(".")  # only the flag's own name, not a dotted JSON key
            out.append(head.replace("_", "-") + dot + tail + eq + value)
        elif a.startswith("-O") and a != "-O":
            out += ["--optimization-level", a[3:] if a[2] == "=" else a[2:]]
        elif a == "-O":
            out.append("--optimization-level")
        else:
            out.append(a)
    return out


def _config_args(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """A YAML --config file as flags, with vLLM's rules (load_config_file)."""
    import yaml

    if path.rsplit(".", 1)[-1] not in ("yaml", "yml"):
        parser.error(f"Config file must be of a yaml/yml type. {path.rsplit('.', 1)[-1]} supplied")
    try:
        with open(path) as f:
            config = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        parser.error(f"cannot read the config file {path}: {e}")
    if not isinstance(config, dict):
        parser.error(f"the config file {path} must be a mapping of flag names to values")
    known = parser._option_string_actions
    out: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            if value:
                out.append(flag)
            elif "--no-" + flag[2:] in known:
                out.append("--no-" + flag[2:])
        elif isinstance(value, list):
            if value:
                out += [flag, *map(str, value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def _split_sim_prefix(argv: list[str]) -> tuple[str, list[str]]:
    """``[sim options] serve|predict rest`` -> (the command, one argument list for its parser)."""
    parser = build_parser()
    pre: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok in COMMANDS:
            return tok, pre + argv[i + 1 :]
        if tok in ("-h", "--help"):
            parser.print_help()
            sys.exit(0)
        key = tok.split("=", 1)[0]
        if key in SIM_OPTIONS:
            if "=" in tok:
                pre.append(tok)
            elif i + 1 < len(argv):
                pre += [tok, argv[i + 1]]
                i += 1
            else:
                parser.error(f"argument {tok}: expected one argument")
        else:
            parser.error(f"expected `serve` or `predict` before {tok!r} (usage: {USAGE})")
        i += 1
    parser.error("the following arguments are required: serve (or predict)")


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The command line of ``serve`` or ``predict`` (``ns.command``), with vLLM's spellings and --config."""
    command, rest = _split_sim_prefix(list(argv))
    parser = build_parser(command)
    args = _normalize(rest)
    if "--config" in args or any(a.startswith("--config=") for a in args):
        i = next(i for i, a in enumerate(args) if a == "--config" or a.startswith("--config="))
        if args[i] == "--config":
            if i + 1 >= len(args):
                parser.error("argument --config: expected one argument")
            path, rest = args[i + 1], args[:i] + args[i + 2 :]
        else:
            path, rest = args[i].split("=", 1)[1], args[:i] + args[i + 1 :]
        extra = _config_args(path, parser)
        # vLLM's order: the model, then the file's flags, then the command line's (which win)
        args = rest[:1] + extra + rest[1:] if rest and not rest[0].startswith("-") else extra + rest
    ns = parser.parse_args(args)
    ns.command = command
    ns.model_tag = ns.model_tag or ns.model
    if not ns.model_tag:
        parser.error(f"the following arguments are required: MODEL (as `{command} MODEL` or --model)")
    return ns


def _fit_max_model_len(values: dict[str, Any], gpu: Any, shape: Any, used: int) -> int:
    """--max-model-len -1/auto: the longest context the KV cache holds, capped at the model's own."""
    from autotune.sim.config import SimConfig
    from autotune.sim.startup import plan_startup

    block = int(values.get("block_size") or 16)
    probe = SimConfig.from_args({**values, "max_model_len": block}, gpu, shape)
    s = plan_startup(shape, gpu, probe, used_by_others=used)
    top = shape.max_position or 8192
    if s.plan is None:
        return top  # start-up fails anyway, with its own message
    return max(block, min(top, s.plan.kv_tokens // block * block))


PREDICT_OUTPUTS = {"command", "slo", "json", "requests_json"}
SHARED_WITH_VLLM = {"seed", "tokenizer"}  # vLLM's flags, which predict's workload reads too


def _sim_keys() -> set[str]:
    """The namespace's keys that are not vLLM flags: the sim's own options and predict's."""
    from autotune.workload.options import WorkloadOptions

    own = {"gpu", "gpu_total_memory", "time_scale", "gpu_memory_used_by_others", "model_tag"}
    return own | PREDICT_OUTPUTS | (WorkloadOptions.names() - SHARED_WITH_VLLM)


def _engine(ns: argparse.Namespace, *, serving: bool = True) -> tuple[Any, Any, dict[str, Any], Any] | None:
    """(shape, GPU, the vLLM flags given, SimConfig). A model it cannot find: serving, None after vLLM's own message
    (serve exits 1, as vLLM does); predicting, a usage error (ConfigError: one line, exit 2)."""
    from autotune.errors import ConfigError
    from autotune.sim.config import SimConfig
    from autotune.sim.profiles import gpu_profile, model_shape

    try:
        shape = model_shape(ns.model_tag)
    except KeyError as e:
        if not serving:
            raise ConfigError(e.args[0]) from e
        print(f"OSError: {e.args[0]}", file=sys.stderr, flush=True)
        return None
    gpu = gpu_profile(ns.gpu)
    if ns.gpu_total_memory:
        gpu = replace(gpu, memory_bytes=ns.gpu_total_memory)
    sim_keys = _sim_keys()
    values = {k: v for k, v in vars(ns).items() if v is not None and k not in sim_keys}
    if values.get("max_model_len") == -1:
        values["max_model_len"] = _fit_max_model_len(values, gpu, shape, ns.gpu_memory_used_by_others)
    return shape, gpu, values, SimConfig.from_args(values, gpu, shape)


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse(sys.argv[1:] if argv is None else argv)
    if ns.command == "predict":
        return _predict(ns)
    # imports that cost time come after the usage checks: a bad command line fails fast
    from autotune.sim import server
    from autotune.sim.text import TextCodec

    engine = _engine(ns)
    if engine is None:
        return 1
    shape, gpu, values, config = engine
    non_default = {k: v for k, v in values.items() if (k, v) not in (("host", HOST_DEFAULT), ("port", PORT_DEFAULT))}
    opts = server.ServeOptions(
        model=ns.model_tag,
        served_names=list(ns.served_model_name or [ns.model_tag]),
        shape=shape,
        gpu=gpu,
        config=config,
        host=ns.host,
        port=ns.port,
        tokenizer=TextCodec.find(ns.tokenizer, ns.model_tag),
        time_scale=ns.time_scale,
        used_by_others=ns.gpu_memory_used_by_others,
        log_stats=not ns.disable_log_stats,
        non_default_args={"model_tag": ns.model_tag, **non_default},
    )
    return server.run(opts)


def _predict(ns: argparse.Namespace) -> int:
    """``vllm-sim predict``: usage and workload errors are one line, exit 2 (autotune's ConfigError)."""
    from autotune.errors import AutotuneError

    try:
        return _run_predict(ns)
    except AutotuneError as e:
        print(f"vllm-sim predict: error: {' '.join(str(e).split())}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # a path the system refused (the workload's readers name the common ones themselves)
        print(f"vllm-sim predict: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


def _run_predict(ns: argparse.Namespace) -> int:
    from autotune.errors import ConfigError
    from autotune.measure.slo import parse_slos
    from autotune.sim import predict
    from autotune.sim.config import not_modelled
    from autotune.sim.profiles import CALIBRATED
    from autotune.sim.text import TextCodec
    from autotune.workload.options import WorkloadOptions

    slos = parse_slos(ns.slo)
    # vLLM's --seed seeds the workload (0 when not given); vLLM's --tokenizer builds the prompts
    options = WorkloadOptions.from_args(
        ns, seed=0 if ns.seed is None else ns.seed, tokenizer=Path(ns.tokenizer) if ns.tokenizer else None
    )
    spec = predict.workload_spec(options, ns.model_tag)
    engine = _engine(ns, serving=False)
    if engine is None:
        return 1
    shape, gpu, values, config = engine
    missing = not_modelled(shape, values, model=ns.model_tag)
    if missing:  # the answer without them would be wrong, not approximate
        advice = "measure it on the GPU" if shape.not_modelled else "predict without them, or measure on the GPU"
        raise ConfigError(f"vllm-sim does not model {missing}; {advice} (autotune bench)")
    workload = predict.load_workload(spec, ns.model_tag)
    if ns.gpu not in CALIBRATED:
        print(
            f"vllm-sim predict: note: the {ns.gpu} profile is its datasheet's peaks with default shares: no "
            "measurement or public run calibrates it",
            file=sys.stderr,
        )
    opts = predict.PredictOptions(
        model=ns.model_tag,
        served_name=(ns.served_model_name or [ns.model_tag])[0],
        shape=shape,
        gpu=gpu,
        gpu_key=ns.gpu,
        config=config,
        used_by_others=ns.gpu_memory_used_by_others,
        tokenizer=TextCodec.find(ns.tokenizer, ns.model_tag),
        load=options.load,
        max_concurrency=options.max_concurrency,
        warmup=options.warmup,
        slos=slos,
        vllm_args={k: v for k, v in values.items() if (k, v) not in (("host", HOST_DEFAULT), ("port", PORT_DEFAULT))},
    )
    return predict.report(predict.predict(opts, workload), ns.json, ns.requests_json)


if __name__ == "__main__":
    sys.exit(main())
