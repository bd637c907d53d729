"""Publish targets: where production's config lives, behind one small protocol and a registry.

A target is created from the daemon config's ``[production]`` table by kind
(``create_target(kind, url, table, where)``); each target class parses its own keys in
``from_settings`` (GuideLLM's ``Backend.create`` is the model), so the daemon never branches
on a kind. What a transaction needs of a target:

    deployed()        the engine args production runs now (None: nothing deployed yet)
    deploy(values)    validate, apply, and return once production serves them (raise on failure)
    production_values(values)  values without what only a staging engine may run
    endpoint()        production's base URL, for health checks and the canary
    canary_client()   how a canary replay must talk to it (API, served model name, key)

Adding a target is one module with a class that has these, and one ``register`` line.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import httpx

from autotune.engine.health import probe
from autotune.errors import ConfigError, PublishError

__all__ = ["Target", "CanaryClient", "register", "create_target", "check_settings", "target_kinds", "wait_healthy"]


@dataclass(frozen=True)
class CanaryClient:
    """How a canary replays against a target: its API, model name and bearer key (None: ask /v1/models)."""

    api: Literal["completion", "chat"] = "completion"
    model: str | None = None
    api_key: str | None = None


class Target(Protocol):
    name: str

    def deployed(self) -> dict[str, Any] | None: ...
    def deploy(self, values: Mapping[str, Any]) -> None: ...
    def endpoint(self) -> str: ...
    def canary_client(self) -> CanaryClient: ...
    def production_values(self, values: Mapping[str, Any]) -> dict[str, Any]: ...


class TargetFactory(Protocol):
    @classmethod
    def check_settings(cls, table: Mapping[str, Any], where: str) -> None: ...
    @classmethod
    def from_settings(cls, url: str, table: Mapping[str, Any], where: str) -> Target: ...


_REGISTRY: dict[str, str | type[TargetFactory]] = {
    "vllm-config": "autotune.publish.vllm_config:VllmConfigTarget",
    "xinference": "autotune.publish.xinference:XinferenceTarget",
    "blue-green": "autotune.publish.bluegreen:BlueGreenTarget",
}


def register(kind: str, factory: str | type[TargetFactory]) -> None:
    """Add (or replace) a target kind: ``"module:Class"`` is imported on first use."""
    _REGISTRY[kind] = factory


def target_kinds() -> list[str]:
    return list(_REGISTRY)


def _factory(kind: str, where: str) -> type[TargetFactory]:
    factory = _REGISTRY.get(kind)
    if factory is None:
        names = [repr(k) for k in _REGISTRY]
        known = " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
        raise ConfigError(f"{where}.kind must be {known}, got {kind!r}")
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(module), attr)
    return factory


def check_settings(kind: str, table: Mapping[str, Any], where: str) -> None:
    """Check a ``[production]`` table for ``kind`` without connecting to anything (at config load)."""
    _factory(kind, where).check_settings(table, where)


def create_target(kind: str, url: str, table: Mapping[str, Any], where: str = "[production]") -> Target:
    return _factory(kind, where).from_settings(url, table, where)


def wait_healthy(url: str, timeout_s: float, interval_s: float = 1.0) -> float:
    """Seconds until GET /health is 200 and /v1/models lists a model; PublishError at the deadline."""
    t0 = time.monotonic()
    last = "no answer"
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() - t0 < timeout_s:
            h = probe(url, client=client)
            last = f"/health {h.status}" if h.status is not None else h.error
            try:
                if h.ok:
                    m = client.get(f"{url}/v1/models")
                    if m.status_code == 200 and m.json().get("data"):
                        return time.monotonic() - t0
            except httpx.HTTPError as e:
                last = type(e).__name__
            time.sleep(interval_s)
    raise PublishError(f"{url} not healthy after {timeout_s:.0f} s (last: {last})")
