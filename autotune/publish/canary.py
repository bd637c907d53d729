"""The canary: a short replay against production, judged by the SLOs, after every publish.

The workload is the caller's: the daemon synthesizes it from production's own traffic
fingerprint, ``autotune publish`` takes the study's workload at its base rate. A canary that
cannot even run (production refuses requests) fails like one that misses an SLO.
"""

from __future__ import annotations

from autotune.errors import AutotuneError
from autotune.measure.replay import ReplayOptions
from autotune.measure.session import measure_url
from autotune.measure.slo import SLO
from autotune.publish.transaction import Canary, CanaryResult
from autotune.workload.trace import Workload

__all__ = ["replay_canary"]

_DEFAULT_REPLAY = ReplayOptions()  # frozen: one instance serves every call


def replay_canary(workload: Workload, slos: list[SLO], options: ReplayOptions = _DEFAULT_REPLAY) -> Canary:
    def run(url: str) -> CanaryResult:
        try:
            result = measure_url(url, lambda _: workload, slos, options)
        except AutotuneError as e:
            return CanaryResult(False, {"error": str(e)})
        summary = result.to_json()
        step = result.last
        ok = result.slos_hold and step is not None and step.summary.failed == 0
        if step is not None and step.summary.failed:
            summary["error"] = f"{step.summary.failed} of {len(workload)} requests failed"
        return CanaryResult(ok, {"metrics": summary["metrics"], "slos": summary["slos"], "error": summary.get("error")})

    return run
