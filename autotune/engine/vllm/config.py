"""vLLM's YAML config file (`vllm serve --config FILE`): the one format autotune writes for vLLM.

The file maps vLLM's long option names (without ``--``) to values, plus ``model``; a study's
best.yaml and production's config are both written here.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from autotune.engine.flags import dest_of, flag_of
from autotune.engine.secrets import REDACTED
from autotune.errors import ConfigError

__all__ = ["STAGING_ONLY", "production_values", "render", "parse", "container_line"]

# vLLM's official image runs `vllm serve` (its Dockerfile's ENTRYPOINT ["vllm", "serve"]): what follows the
# image name on a `docker run` line are vllm serve's own arguments
IMAGE = "vllm/vllm-openai"
# vLLM's own image of its CPU build (x86_64), for a study measured on it (docs.vllm.ai, "Using Docker")
CPU_IMAGE = "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo"
CONFIG_IN_CONTAINER = "/etc/vllm/config.yaml"
CONTAINER_ARGS = ("--config", CONFIG_IN_CONTAINER, "--host", "0.0.0.0", "--port", "8000")
# env vars that name a host directory vLLM writes (its compile cache): mounted, and named at their absolute path
DIR_ENV = ("VLLM_CACHE_ROOT",)

# staging-only values: measuring with random weights is fine, serving them is not
STAGING_ONLY: dict[str, Any] = {"load_format": "dummy"}


def production_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` without what only a staging engine may run."""
    return {k: v for k, v in values.items() if STAGING_ONLY.get(k, object()) != v}


def _entry(name: str, value: Any) -> tuple[str, Any]:
    # vLLM's load_config_file turns `key: false` into --no-key only when the top-level parser owns that
    # option, which for `vllm serve` it never does: the value is silently dropped and the default (often
    # true: prefix caching) runs (vllm-project/vllm#51401; tests/test_production_vllm.py). `no-key: true`
    # becomes --no-key, which the serve parser reads: the same argv EngineArgs.to_args gives.
    flag = flag_of(name)[2:]
    return (f"no-{flag}", True) if value is False else (flag, value)


def container_line(model: str, config_path: Path, env: Mapping[str, str], version: str | None) -> str:
    """``docker run`` of the official image serving ``config_path``, for the build the study measured: its CPU
    image for vLLM's CPU build (a version ``+cpu``), else the CUDA image on all GPUs; the tag is that version.
    The host's Hugging Face cache is mounted where the image looks (/root/.cache/huggingface), port 8000 published
    on localhost only, a local model directory mounted read-only at its absolute path and named there (the
    config's path may be relative to where the study ran), ``env`` passed (a redacted secret by name only, so
    docker takes it from the caller's environment; a directory of ``DIR_ENV`` mounted read-write at its absolute
    path, so the compile cache the study filled serves the container too)."""
    cpu = version is not None and "+cpu" in version
    tag = f"v{version.split('+')[0]}" if version else "latest"
    words = ["docker", "run", "--rm", *([] if cpu else ["--gpus", "all"]), "--ipc=host", "-p", "127.0.0.1:8000:8000"]
    cache = '-v "${HF_HOME:-$HOME/.cache/huggingface}:/root/.cache/huggingface"'  # expanded by the shell
    mounts = ["-v", f"{Path(config_path).resolve()}:{CONFIG_IN_CONTAINER}:ro"]
    served: list[str] = []
    if Path(model).is_dir():
        local = str(Path(model).resolve())
        mounts += ["-v", f"{local}:{local}:ro"]
        served = [local]  # vllm serve's model argument wins over the config's (a path relative to the study's)
    env = dict(env)
    for k in DIR_ENV:
        if k in env and env[k] != REDACTED:
            env[k] = str(Path(env[k]).resolve())
            mounts += ["-v", f"{env[k]}:{env[k]}"]
    envs = ["-e", "HF_TOKEN"] + [
        a for k, v in env.items() if k != "HF_TOKEN" for a in ("-e", k if v == REDACTED else f"{k}={v}")
    ]
    image = f"{CPU_IMAGE if cpu else IMAGE}:{tag}"
    return " ".join([shlex.join(words), cache, shlex.join([*mounts, *envs, image, *served, *CONTAINER_ARGS])])


def render(model: str, values: Mapping[str, Any], header: Sequence[str] = ()) -> str:
    config = {"model": model, **dict(_entry(k, v) for k, v in production_values(values).items())}
    lines = [f"# {h}" for h in header]
    return ("\n".join(lines) + "\n" if lines else "") + yaml.safe_dump(config, sort_keys=False)


def parse(text: str, source: str = "") -> tuple[str | None, dict[str, Any]]:
    """(model, values in snake case) from a config file's text; ``source`` (the file) names it in errors."""
    where = f"{source}: " if source else ""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError(f"{where}not valid YAML: {problem}{at}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}a vLLM config file is a YAML mapping of option names to values")
    model = data.pop("model", None)
    values: dict[str, Any] = {}
    for k, v in data.items():
        key = str(k).replace("_", "-")
        if key.startswith("no-") and v is True:
            values[dest_of("--" + key[3:])] = False
        else:
            values[dest_of("--" + key)] = v
    return model, values
