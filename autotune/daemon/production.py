"""Production as the daemon sees it: the publish target its config names, and a canary that looks
like its traffic. ``autotune publish`` and ``autotune rollback`` use these too, without a daemon."""

from __future__ import annotations

import time
from pathlib import Path

from autotune.daemon.config import DaemonConfig
from autotune.daemon.fingerprint import Fingerprint, workload_from
from autotune.errors import AutotuneError
from autotune.locations import state_dir
from autotune.measure.replay import ReplayOptions
from autotune.publish.canary import replay_canary
from autotune.publish.target import Target, create_target
from autotune.publish.transaction import Canary
from autotune.workload.prompts import PromptBuilder, load_tokenizer, materialize

__all__ = ["build_target", "production_canary", "daemon_root"]


def daemon_root(cfg: DaemonConfig) -> Path:
    """Where this daemon keeps its state, history and tunings."""
    return state_dir() / "daemon" / cfg.name


def build_target(cfg: DaemonConfig) -> Target:
    p = cfg.production
    return create_target(p.kind, p.url, p.settings, f"{cfg.source.name if cfg.source else 'daemon'} [production]")


def production_canary(cfg: DaemonConfig, target: Target, fingerprint: Fingerprint | None,
                      tokenizer: str | Path) -> Canary:
    """A short replay shaped like production's traffic (its last fingerprint), judged by its SLOs."""
    if fingerprint is None:
        raise AutotuneError("no traffic fingerprint yet: nothing to build a canary from")
    client = target.canary_client()
    w = workload_from(fingerprint, requests=cfg.canary_requests, seed=int(time.time()) % 1000, name="canary",
                      api=client.api)
    w = materialize(w, PromptBuilder(load_tokenizer(tokenizer)), seed=1)
    return replay_canary(w, cfg.slos, ReplayOptions(warmup_requests=0, api_key=client.api_key, model=client.model))
