"""What autotune knows about vLLM's command-line flags.

Which flags a vLLM accepts comes, in order of trust, from:
1. vLLM's own argument parser, run in the engine's Python (``dump_flags``), cached per
   interpreter and vLLM version under ``~/.cache/autotune/vllm-flags/``;
2. else the bundled table of the supported versions (``vllm_flags.json``, produced by
   the same dump; ``scripts/dump_vllm_flags.py`` regenerates it).

The blog-post flags in REMOVED get a specific hint when a study uses them; MANAGED flags are
autotune's own to set.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from functools import cache
from importlib import resources
from pathlib import Path

from autotune.engine.flags import FlagTable
from autotune.errors import ConfigError

__all__ = [
    "REMOVED",
    "MANAGED",
    "DUMP_CODE",
    "bundled_table",
    "bundled_versions",
    "dump_flags",
    "engine_python",
    "table_for_command",
    "FRONTEND_ARGS",
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


def _vllm_table(dump: dict, source: str) -> FlagTable:
    """A dumped flag table with vLLM's removed and managed flags and its names in messages."""
    return FlagTable.from_dump(
        dump, source, removed=REMOVED, managed=MANAGED, engine="vLLM", help_command="`vllm serve --help=all`"
    )


@cache
def _bundled() -> dict:
    return json.loads(resources.files("autotune.engine.vllm").joinpath("vllm_flags.json").read_text())


def bundled_versions() -> list[str]:
    return sorted(_bundled())


def bundled_table(version: str) -> FlagTable:
    """The table for ``version`` (0.32.0+cpu -> 0.32, v0.33.1 -> 0.33); one we have no table for is a
    ConfigError naming those we have: checking flags against another version's table would pass flags
    that version does not take, or refuse ones it does."""
    tables = _bundled()
    key = ".".join(version.strip().removeprefix("v").split("+")[0].split(".")[:2])
    if key not in tables:
        raise ConfigError(
            f"no flag table for vLLM {version!r}: autotune bundles {', '.join(bundled_versions())}; "
            "give one of them, or run autotune where the engine's vLLM is installed so its own "
            "parser is read"
        )
    return _vllm_table(tables[key], f"bundled:{key}")


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
            capture_output=True,
            text=True,
            timeout=60,
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
        out = subprocess.run(
            [python, "-c", DUMP_CODE],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
        )
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


def table_for_command(command: list[str], version: str | None = None) -> FlagTable:
    """The flags the vLLM behind ``command`` accepts: its own parser if we can run it, else the bundled
    table of ``version`` (default: the newest). A ``version`` we have no table for is an error either way."""
    bundled = bundled_table(bundled_versions()[-1] if version is None else version)
    python = engine_python(command)
    if python is not None:
        dump = dump_flags(python)
        if dump is not None:
            return _vllm_table(dump, "parser")
    return bundled


# Options of `vllm serve`'s API server, not AsyncEngineArgs fields (vLLM 0.32's parser): what an engine
# embedded in another server (Xinference's) has nowhere to put.
FRONTEND_ARGS: frozenset[str] = frozenset(
    {
        "allow_credentials",
        "allowed_headers",
        "allowed_methods",
        "allowed_origins",
        "anthropic_disabled_thinking_effort",
        "api_key",
        "api_server_count",
        "chat_template",
        "chat_template_content_format",
        "cohere_format",
        "cohere_is_reasoning_model",
        "config",
        "data_parallel_supervisor_port",
        "default_chat_template_kwargs",
        "disable_access_log_for_endpoints",
        "disable_fastapi_docs",
        "disable_uvicorn_access_log",
        "dp_supervisor_probe_failure_threshold",
        "dp_supervisor_probe_interval_s",
        "dp_supervisor_probe_timeout_s",
        "enable_auto_tool_choice",
        "enable_flash_late_interaction",
        "enable_force_include_usage",
        "enable_log_deltas",
        "enable_log_outputs",
        "enable_offline_docs",
        "enable_per_request_metrics",
        "enable_prompt_tokens_details",
        "enable_request_id_headers",
        "enable_scale_out",
        "enable_server_load_tracking",
        "enable_ssl_refresh",
        "enable_tokenizer_info_endpoint",
        "exclude_tools_when_tool_choice_none",
        "fingerprint_mode",
        "fingerprint_value",
        "grpc",
        "grpc_port",
        "h11_max_header_count",
        "h11_max_incomplete_event_size",
        "headless",
        "host",
        "log_error_stack",
        "lora_modules",
        "max_log_len",
        "middleware",
        "port",
        "response_role",
        "return_tokens_as_token_ids",
        "root_path",
        "sse_keep_alive_interval",
        "ssl_ca_certs",
        "ssl_cert_reqs",
        "ssl_certfile",
        "ssl_ciphers",
        "ssl_keyfile",
        "tool_call_parser",
        "tool_parser_plugin",
        "tool_server",
        "tool_strict_level",
        "trust_request_chat_template",
        "trust_request_mm_kwargs",
        "uds",
        "uvicorn_log_level",
    }
)
