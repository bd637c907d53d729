"""Production as the daemon sees it: the publish target its config names, and a canary that looks
like its traffic. ``autotune publish`` and ``autotune rollback`` use these too, without a daemon."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from autotune.daemon.config import DaemonConfig
from autotune.daemon.fingerprint import Fingerprint, workload_from
from autotune.daemon.prometheus import scrape
from autotune.daemon.window import Window
from autotune.errors import AutotuneError, PublishError
from autotune.locations import state_dir
from autotune.measure.replay import ReplayOptions
from autotune.measure.slo import SLO
from autotune.publish.canary import replay_canary
from autotune.publish.target import Target, create_target
from autotune.publish.transaction import Canary, CanaryResult
from autotune.workload.prompts import PromptBuilder, load_tokenizer, materialize

__all__ = [
    "build_target",
    "production_canary",
    "production_verifier",
    "switch_verifier",
    "daemon_root",
    "find_daemon_root",
    "has_state",
    "SYSTEMD_STATE_DIR",
]

SYSTEMD_STATE_DIR = Path("/var/lib/autotune")  # systemd/autotune.service: StateDirectory=autotune


def daemon_root(cfg: DaemonConfig) -> Path:
    """Where this daemon keeps its state, history and tunings: under the config's ``state_dir`` when it
    names one, else under locations.state_dir() ($AUTOTUNE_STATE_DIR, $STATE_DIRECTORY, ~/.local/state)."""
    return (cfg.state_dir or state_dir()) / "daemon" / cfg.name


def _has_state(root: Path) -> bool:
    try:
        return (root / "state.json").is_file() or (root / "history").is_dir()
    except OSError:  # a directory we may not read: not ours to use
        return False


def find_daemon_root(cfg: DaemonConfig) -> tuple[Path, list[Path]]:
    """For the commands beside a daemon (status, retune, publish, rollback, history): the directory its
    daemon keeps its state in, found from its config, and the directories looked in.

    The config's ``state_dir`` decides when it names one. Else the first of this environment's state
    directory and systemd's (/var/lib/autotune) where a daemon of this name has left state; when
    neither has any, this environment's (the caller says that no daemon has run there yet)."""
    if cfg.state_dir is not None:
        root = daemon_root(cfg)
        return root, [root]
    looked = list(dict.fromkeys([state_dir() / "daemon" / cfg.name, SYSTEMD_STATE_DIR / "daemon" / cfg.name]))
    for root in looked:
        if _has_state(root):
            return root, looked
    return looked[0], looked


def has_state(root: Path) -> bool:
    """Has a daemon kept state (its state file or its publish history) in ``root``?"""
    return _has_state(root)


def build_target(cfg: DaemonConfig) -> Target:
    p = cfg.production
    return create_target(p.kind, p.url, p.settings, f"{cfg.source.name if cfg.source else 'daemon'} [production]")


def switch_verifier(cfg: DaemonConfig, target: Target) -> Canary | None:
    """How a blue/green switch is verified (its [production].verify_window of users' traffic); None for
    targets that publish in place (their canary is the verification)."""
    window = getattr(target, "verify_window_s", None)
    return None if window is None else production_verifier(cfg.slos, window)


def production_canary(
    cfg: DaemonConfig, target: Target, fingerprint: Fingerprint | None, tokenizer: str | Path
) -> Canary:
    """A short replay shaped like production's traffic (its last fingerprint), judged by its SLOs."""
    if fingerprint is None:
        raise AutotuneError("no traffic fingerprint yet: nothing to build a canary from")
    client = target.canary_client()
    w = workload_from(
        fingerprint, requests=cfg.canary_requests, seed=int(time.time()) % 1000, name="canary", api=client.api
    )
    w = materialize(w, PromptBuilder(load_tokenizer(tokenizer)), seed=1)
    return replay_canary(w, cfg.slos, ReplayOptions(warmup_requests=0, api_key=client.api_key, model=client.model))


def production_verifier(slos: list[SLO], window_s: float, min_requests: int = 5) -> Canary:
    """After a blue/green switch: users' own requests on the new color, read from its /metrics over
    ``window_s``, judged by the SLOs. Too few requests to judge (a quiet hour) keep the switch, since
    the canary judged the config before it, but as not verified (``verified`` false in the summary),
    which the publish's entry and the journal say."""

    def run(url: str) -> CanaryResult:
        try:
            first = scrape(url)
            time.sleep(window_s)
            last = scrape(url)
        except (httpx.HTTPError, ValueError) as e:
            raise PublishError(f"cannot read {url}/metrics after the switch: {type(e).__name__}: {e}") from e
        w = Window.between(first, last)
        judged = [e for e in w.slo_compliance(slos) if e.slo.is_latency]
        summary: dict[str, Any] = {
            "requests": w.requests,
            "window_s": round(w.dt, 1),
            "slos": [{"slo": str(e.slo), "measured": e.value, "holds": e.holds} for e in judged],
        }
        if w.requests < min_requests:
            summary["note"] = f"{w.requests} requests in {w.dt:.0f} s: too few to judge; the canary's verdict stands"
            summary["slos"] = [dict(v, holds=None) for v in summary["slos"]]
            return CanaryResult(True, {**summary, "verified": False})
        return CanaryResult(all(e.holds is not False for e in judged), {**summary, "verified": True})

    return run
