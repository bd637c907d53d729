"""Everything autotune knows about vLLM's command-line flags, in one place.

Which flags a vLLM accepts comes, in order of trust, from:
1. vLLM's own argument parser, run in the engine's Python (``dump_flags``), cached per
   interpreter and vLLM version under ``~/.cache/autotune/vllm-flags/``;
2. else the bundled table of the supported versions (``vllm_flags.json``, produced by
   the same dump; ``scripts/dump_vllm_flags.py`` regenerates it).

``check_args`` walks an argv against a table before any launch; a flag that does not exist
is an ``UnknownFlagError`` naming the flag and what to use instead: the blog-post flags in
REMOVED get a specific hint, others the closest real flags.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

from autotune.errors import ConfigError, UnknownFlagError

__all__ = [
    "Flag",
    "FlagTable",
    "REMOVED",
    "MANAGED",
    "bundled_table",
    "table_for_engine",
    "check_args",
    "dest_of",
    "flag_of",
    "vllm_default_batching",
    "SIMULATED_VLLM",
    "is_simulator",
]

# Flags that people copy from blog posts and old docs, with what to do instead (checked against 0.32/0.33).
REMOVED: dict[str, str] = {
    "--enable-cuda-graph": "never existed: CUDA graphs are on by default; --enforce-eager turns them off, "
    "--compilation-config '{\"cudagraph_mode\": ...}' shapes them",
    "--max-cpu-layers": "never existed in vLLM; to hold part of the weights in CPU memory use --cpu-offload-gb, "
    "for KV cache in CPU memory --kv-offloading-size",
    "--scheduler-delay-factor": "removed with the V0 engine; batching is shaped by --max-num-batched-tokens "
    "and --long-prefill-token-threshold",
    "--swap-space": "removed: the V1 engine preempts by recompute and has no CPU swap; "
    "for KV cache in CPU memory use --kv-offloading-size",
    "--num-scheduler-steps": "removed with V0 multi-step scheduling; overlap scheduling is --async-scheduling",
    "--preemption-mode": "removed: the V1 engine always preempts by recompute",
    "--enable-prefix-projection": "not a vLLM flag; prefix caching is --enable-prefix-caching (on by default)",
    "--use-v2-block-manager": "removed: the V1 block manager is the only one",
}

# Flags autotune sets itself: a user value would fight the launcher or bypass the validated space.
MANAGED: dict[str, str] = {
    "--host": "autotune binds the engine itself: set the host in the engine settings (default 127.0.0.1)",
    "--port": "autotune picks the engine port: use autotune's --port",
    "--config": "engine args must come from autotune's validated space, not a YAML file",
    "--help": "not an engine setting",
    "-h": "not an engine setting",
}


@dataclass(frozen=True)
class Flag:
    name: str  # the long form, e.g. --max-num-seqs
    kind: str  # "bool" (--x / --no-x), "switch" (--x only), or "value"
    type: str  # int, float, str, json, bool
    choices: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class FlagTable:
    version: str
    source: str  # "parser" (vLLM's own) or "bundled"
    flags: dict[str, Flag]  # every spelling (long, alias, --no-x) -> Flag

    def lookup(self, spelling: str) -> Flag | None:
        return self.flags.get(spelling)

    @classmethod
    def from_dump(cls, dump: dict, source: str) -> FlagTable:
        flags: dict[str, Flag] = {}
        for row in dump["flags"]:
            f = Flag(row["name"], row["kind"], row["type"], tuple(row.get("choices") or ()), tuple(row.get("aliases") or ()))
            for s in (f.name, *f.aliases):
                flags[s] = f
            if f.kind == "bool":
                flags["--no-" + f.name[2:]] = f
        return cls(dump["version"], source, flags)


def dest_of(flag: str) -> str:
    """--max-num-seqs -> max_num_seqs (the name autotune and Optuna use)."""
    return flag.lstrip("-").replace("-", "_")


def flag_of(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def vllm_default_batching(platform: str, gpu_memory_gib: float = 0.0, gpu_name: str = "") -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) that vLLM 0.33's API server picks (engine/arg_utils.py)."""
    if platform == "cpu":
        return 128, 2048
    if gpu_memory_gib >= 160:
        return 1024, 16384
    if gpu_memory_gib >= 70 and "a100" not in gpu_name.lower():
        return 1024, 8192
    return 256, 2048


# --- where tables come from ----------------------------------------------------------------

@lru_cache(maxsize=None)
def _bundled() -> dict:
    return json.loads(resources.files("autotune.engine").joinpath("vllm_flags.json").read_text())


def bundled_versions() -> list[str]:
    return sorted(_bundled())


def bundled_table(version: str) -> FlagTable:
    """The table for ``version`` (0.32.0+cpu -> 0.32); unknown versions get the newest table we have."""
    tables = _bundled()
    mm = ".".join(version.split("+")[0].split(".")[:2])
    key = mm if mm in tables else bundled_versions()[-1]
    return FlagTable.from_dump(tables[key], source=f"bundled:{key}")


# Runs inside the engine's Python: vLLM's own parser, flattened to JSON.
DUMP_CODE = r"""
import argparse, json, sys
from importlib.metadata import version
import importlib
for where in ("common", "launchers", "openai"):  # 0.33, 0.32, older
    try:
        make_arg_parser = importlib.import_module(f"vllm.entrypoints.{where}.cli_args").make_arg_parser
        break
    except ImportError:
        continue
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser())
rows = []
for a in parser._actions:
    longs = [s for s in a.option_strings if s.startswith("--") and not s.startswith("--no-")]
    if not longs or isinstance(a, argparse._HelpAction):
        continue
    name = "--" + a.dest.replace("_", "-") if "--" + a.dest.replace("_", "-") in longs else longs[0]
    negs = [s for s in a.option_strings if s.startswith("--no-")]
    if isinstance(a, argparse.BooleanOptionalAction) or negs:
        kind, typ = "bool", "bool"
    elif a.nargs == 0:
        kind, typ = "switch", "bool"
    else:
        kind = "value"
        t = a.type
        typ = {int: "int", float: "float", str: "str"}.get(t)
        if typ is None:
            n = getattr(t, "__name__", "") or ""
            typ = "json" if "dataclass" in n or "json" in n.lower() else "str"
    aliases = [s for s in a.option_strings if s != name and not s.startswith("--no-")]
    rows.append({"name": name, "kind": kind, "type": typ,
                 "choices": [str(c) for c in a.choices] if a.choices else [],
                 "aliases": aliases})
print(json.dumps({"version": version("vllm"), "flags": rows}))
"""


def engine_python(command: list[str]) -> str | None:
    """The Python interpreter that runs an engine command, if it can be told without running it."""
    if not command:
        return None
    exe = shutil.which(command[0]) or command[0]
    name = os.path.basename(exe)
    if name.startswith("python"):
        return exe
    try:
        with open(exe, "rb") as f:
            first = f.readline(400).decode("utf-8", "replace").strip()
    except OSError:
        return None
    if first.startswith("#!"):
        parts = first[2:].split()
        if parts and os.path.basename(parts[0]) == "env" and len(parts) > 1:
            return shutil.which(parts[1])
        if parts and "python" in os.path.basename(parts[0]):
            return parts[0]
    return None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autotune" / "vllm-flags"


def _vllm_version(python: str) -> str | None:
    try:
        out = subprocess.run(
            [python, "-c", "from importlib.metadata import version; print(version('vllm'))"],
            capture_output=True, text=True, timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def dump_flags(python: str, timeout: float = 300) -> dict | None:
    """vLLM's own parser, read in its own interpreter; cached per (interpreter, vLLM version)."""
    version = _vllm_version(python)
    if version is None:
        return None
    key = hashlib.sha256(f"{os.path.realpath(python)}|{version}".encode()).hexdigest()[:16]
    cached = _cache_dir() / f"{version}-{key}.json"
    if cached.is_file():
        try:
            return json.loads(cached.read_text())
        except json.JSONDecodeError:
            pass
    try:
        out = subprocess.run([python, "-c", DUMP_CODE], capture_output=True, text=True, timeout=timeout,
                             env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    try:
        dump = json.loads(out.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return None
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    tmp.write_text(json.dumps(dump))
    os.replace(tmp, cached)
    return dump


# The vLLM whose command line vllm-sim (autotune.sim) accepts.
SIMULATED_VLLM = "0.33"


def is_simulator(command: list[str]) -> bool:
    return bool(command) and (os.path.basename(command[0]) == "vllm-sim" or "autotune.sim.cli" in command[:3])


def table_for_engine(command: list[str], version: str | None = None) -> FlagTable:
    """The flags the engine behind ``command`` accepts: its own parser if we can run it, else bundled."""
    if is_simulator(command):
        return bundled_table(SIMULATED_VLLM)  # its Python may hold another vLLM; the sim takes 0.33's flags
    python = engine_python(command)
    if python is not None:
        dump = dump_flags(python)
        if dump is not None:
            return FlagTable.from_dump(dump, source="parser")
    return bundled_table(version or bundled_versions()[-1])


# --- checking an argv ----------------------------------------------------------------------

def _hint(spelling: str, table: FlagTable) -> str:
    if spelling in REMOVED:
        return REMOVED[spelling]
    close = difflib.get_close_matches(spelling, [s for s in table.flags if s.startswith("--")], n=3, cutoff=0.75)
    if close:
        return "did you mean " + " or ".join(close) + "?"
    return f"vLLM {table.version} has no such flag; see `vllm serve --help=all`"


def check_args(args: list[str], table: FlagTable) -> list[tuple[Flag, str, str | None]]:
    """Check engine args (no model, no host/port) against ``table``.

    Returns (flag, spelling, value) per flag; raises UnknownFlagError or ConfigError on the first problem.
    """
    out: list[tuple[Flag, str, str | None]] = []
    i = 0
    while i < len(args):
        tok = args[i]
        if not tok.startswith("-") or tok == "-":
            raise ConfigError(f"unexpected engine argument {tok!r}: engine args are --flag [value] pairs; "
                              "the model is given separately")
        spelling, eq, inline = tok.partition("=")
        if spelling in MANAGED:
            raise ConfigError(f"engine flag {spelling} is not allowed here: {MANAGED[spelling]}")
        flag = table.lookup(spelling)
        if flag is None:
            raise UnknownFlagError(spelling, _hint(spelling, table))
        value: str | None = inline if eq else None
        if flag.kind == "value" and not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"engine flag {spelling} needs a value")
            value = args[i + 1]
            i += 1
        elif flag.kind != "value" and eq:
            raise ConfigError(f"engine flag {spelling} is a switch and takes no value; "
                              f"write {spelling}" + (f" or --no-{flag.name[2:]}" if flag.kind == "bool" else ""))
        if value is not None:
            _check_value(flag, spelling, value)
        out.append((flag, spelling, value))
        i += 1
    return out


def _check_value(flag: Flag, spelling: str, value: str) -> None:
    if flag.choices and value not in flag.choices:
        raise ConfigError(f"engine flag {spelling} {value!r} is not one of: {', '.join(flag.choices)}")
    try:
        if flag.type == "int":
            int(value)
        elif flag.type == "float":
            float(value)
        elif flag.type == "json" and value.lstrip().startswith("{"):
            json.loads(value)
    except ValueError as e:
        raise ConfigError(f"engine flag {spelling} expects {flag.type}, got {value!r}") from e
