"""The ``vllm-sim`` command: ``vllm serve`` for a GPU that is not there.

    vllm-sim [--gpu NAME] [--time-scale F] [--gpu-memory-used-by-others BYTES] serve MODEL [vLLM flags...]

The command line is vLLM 0.33's: the parser is built from the bundled flag table
(``engine.vllm.flags.bundled_table("0.33")``), so every flag a real ``vllm serve`` accepts is
accepted (boolean flags with their ``--no-`` forms and their ``--enable-``/``--disable-``
twins), anything else is argparse's usage error (``error: unrecognized arguments: --foo``,
exit 2), underscores may stand for dashes, and ``--config FILE.yaml`` is spliced in the way
vLLM's FlexibleArgumentParser does it (after the model, before the other flags: the command
line wins). Only the flags ``SimConfig`` reads change the simulation; the rest are accepted
and ignored. The sim's own options (``--gpu``, ``--time-scale``, ``--gpu-memory-used-by-others``)
may come before or after ``serve``.

MODEL is a named profile (llama-3.1-8b, qwen2.5-32b, llama-3.1-70b), a Hugging Face id of
one of them, or a directory with config.json (and tokenizer.json, used to count prompts).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from autotune.engine.flags import Flag, dest_of
from autotune.engine.vllm.flags import bundled_table
from autotune.sim.kind import SIMULATED_VLLM
from autotune.engine.model import parse_bytes

__all__ = ["build_parser", "main", "parse"]

SIM_OPTIONS = {"--gpu": "gpu", "--time-scale": "time_scale", "--gpu-memory-used-by-others": "gpu_memory_used_by_others"}
USAGE = ("vllm-sim [--gpu NAME] [--time-scale F] [--gpu-memory-used-by-others BYTES] "
         "serve MODEL [vLLM flags...]")
HOST_DEFAULT, PORT_DEFAULT = "127.0.0.1", 8000
# vLLM's human_readable_int flags (engine/arg_utils.py): 8k = 8000, 8K = 8192
HUMAN_READABLE_INTS = {"max_num_batched_tokens", "max_num_scheduled_tokens", "kv_cache_memory_bytes",
                       "safetensors_prefetch_block_size", "max_num_queued_tokens"}


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

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, _bool_value(self.flag_name, option_string or self.flag_name))


def _bool_value(name: str, spelling: str) -> bool:
    if spelling.startswith("--no-"):
        return False
    for a, b in (("--enable-", "--disable-"), ("--disable-", "--enable-")):
        if name.startswith(a) and spelling.startswith(b):
            return False
    return True


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own format: the launcher's classifier reads it
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
        try:
            kw["choices"] = [conv(c) for c in flag.choices]
        except (ValueError, TypeError):
            pass
    group.add_argument(*spellings, **kw)


def build_parser() -> argparse.ArgumentParser:
    from autotune.sim.profiles import GPUS

    p = _Parser(prog="vllm-sim serve", usage=USAGE, allow_abbrev=False,
                description="vllm serve, simulated: vLLM 0.33's API, start-up and scheduling on a simulated GPU.")
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="a named model, a Hugging Face id we know, "
                   "or a directory with config.json")
    sim = p.add_argument_group("vllm-sim")
    sim.add_argument("--gpu", default="h100-80gb", choices=sorted(GPUS), help="the simulated GPU (default h100-80gb)")
    sim.add_argument("--time-scale", type=float, default=1.0,
                     help="multiplies the start-up phases' durations (tests: 0.01); serving runs in real time")
    sim.add_argument("--gpu-memory-used-by-others", type=parse_bytes, default=0, metavar="BYTES",
                     help="GPU memory other processes hold (default 0)")
    eng = p.add_argument_group("vLLM 0.33 engine and server flags")
    seen: set[str] = set()
    for flag in bundled_table(SIMULATED_VLLM).flags.values():
        if flag.name not in seen:
            seen.add(flag.name)
            _add_flag(eng, flag)
    return p


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


def _split_sim_prefix(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``[sim options] serve rest`` -> one argument list for the serve parser."""
    pre: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "serve":
            return pre + argv[i + 1:]
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
            parser.error(f"expected `serve` before {tok!r} (usage: {USAGE})")
        i += 1
    parser.error("the following arguments are required: serve")
    raise AssertionError  # parser.error exits


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = build_parser()
    args = _normalize(_split_sim_prefix(list(argv), parser))
    if "--config" in args or any(a.startswith("--config=") for a in args):
        i = next(i for i, a in enumerate(args) if a == "--config" or a.startswith("--config="))
        if args[i] == "--config":
            if i + 1 >= len(args):
                parser.error("argument --config: expected one argument")
            path, rest = args[i + 1], args[:i] + args[i + 2:]
        else:
            path, rest = args[i].split("=", 1)[1], args[:i] + args[i + 1:]
        extra = _config_args(path, parser)
        # vLLM's order: the model, then the file's flags, then the command line's (which win)
        if rest and not rest[0].startswith("-"):
            args = rest[:1] + extra + rest[1:]
        else:
            args = extra + rest
    ns = parser.parse_args(args)
    ns.model_tag = ns.model_tag or ns.model
    if not ns.model_tag:
        parser.error("the following arguments are required: MODEL (as `serve MODEL` or --model)")
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


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse(sys.argv[1:] if argv is None else argv)
    # imports that cost time come after the usage checks: a bad command line fails fast
    from autotune.sim import server
    from autotune.sim.config import SimConfig
    from autotune.sim.profiles import gpu_profile, model_shape
    from autotune.sim.text import TextCodec

    try:
        shape = model_shape(ns.model_tag)
    except KeyError as e:
        print(f"OSError: {e.args[0]}", file=sys.stderr, flush=True)
        return 1
    gpu = gpu_profile(ns.gpu)
    sim_keys = {"gpu", "time_scale", "gpu_memory_used_by_others", "model_tag"}
    values = {k: v for k, v in vars(ns).items() if v is not None and k not in sim_keys}
    if values.get("max_model_len") == -1:
        values["max_model_len"] = _fit_max_model_len(values, gpu, shape, ns.gpu_memory_used_by_others)
    config = SimConfig.from_args(values, gpu, shape)
    non_default = {k: v for k, v in values.items()
                   if (k, v) not in (("host", HOST_DEFAULT), ("port", PORT_DEFAULT))}
    opts = server.ServeOptions(
        model=ns.model_tag,
        served_names=list(ns.served_model_name or [ns.model_tag]),
        shape=shape, gpu=gpu, config=config, host=ns.host, port=ns.port,
        tokenizer=TextCodec.find(ns.tokenizer, ns.model_tag),
        time_scale=ns.time_scale, used_by_others=ns.gpu_memory_used_by_others,
        log_stats=not ns.disable_log_stats,
        non_default_args={"model_tag": ns.model_tag, **non_default},
    )
    return server.run(opts)


if __name__ == "__main__":
    sys.exit(main())
