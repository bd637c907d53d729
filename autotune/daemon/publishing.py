"""The daemon's publishing phase: proposals a person approves, publishes as transactions, rollbacks by hand.

A publish (publish/transaction.py) runs on one worker thread, never on the daemon's tick, which only follows
its phase (``publishing`` -> ``verifying`` -> ``watching``, or ``rolling_back``) and keeps the watchdog fed
through a long health wait. ``Publishing`` owns that thread and the one job on it: a publish, or a rollback
by hand during a tuning (the tuning phase waits for it). A publish a restart cut short is recovered at start-up.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

from autotune.daemon.fingerprint import Fingerprint
from autotune.daemon.phase import PhaseHost
from autotune.daemon.production import production_canary, switch_verifier
from autotune.daemon.state import Phase
from autotune.errors import AutotuneError
from autotune.publish.history import Entry
from autotune.publish.transaction import Canary, PublishLock, publish, recover, rollback

__all__ = ["Publishing"]


class Publishing:
    """The publish thread and its job (None: nothing in flight), and the rollbacks by hand this daemon made."""

    def __init__(self, daemon: PhaseHost) -> None:
        self.d = daemon
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish")
        self.job: concurrent.futures.Future[Any] | None = None
        self.told: set[int] = set()  # rollbacks by hand this daemon ran and said itself

    def submit(self, values: dict[str, Any], source: dict[str, Any], entry: Entry | None = None) -> None:
        """Publish ``values`` on the publish thread (``done`` reads its outcome once the job is done)."""
        self.job = self.pool.submit(self._publish, values, source, entry)

    def start_rollback(self, to: int) -> None:
        self.job = self.pool.submit(self._rollback, to)

    def rollback_result(self) -> Entry | None:
        """The finished rollback's new entry (None: production already ran that config); AutotuneError if it failed."""
        job, self.job = self.job, None
        assert job is not None  # called once the rollback's job is done (TuningPhase.step)
        entry = job.result()
        if entry is not None:
            self.told.add(entry.number)
        return entry

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)  # a publish in flight finishes: never leave production half-done

    def recover_open(self) -> None:
        """Settle the publish a previous run left open (``recover``), and say what became of it."""
        if self.d.history.open_entry() is None:
            return
        try:
            # the canary is built when used: a blue/green switch is re-verified on /metrics instead
            result = recover(
                self.d.target,
                self.d.history,
                lambda url: self.canary()(url),
                verify=switch_verifier(self.d.cfg, self.d.target),
            )
        except AutotuneError as e:
            self.d.decided(
                Phase.WATCHING,
                note=f"PRODUCTION NEEDS A PERSON: could not recover the publish a restart cut short: {e}",
            )
        else:
            assert result is not None  # an entry was open, and the lock keeps it so
            self._recovered(result.entry)

    def _rollback(self, to: int) -> Entry | None:
        with PublishLock(self.d.root):
            return rollback(self.d.target, self.d.history, to)

    def awaiting_approval(self) -> None:
        """`autotune publish --approve` leaves the entry it approves in the state directory; the daemon
        publishes it here, on its own loop (publishing, verifying, and a rollback if it fails, as for its
        own winners). `--reject` settles the proposal itself; so does a newer proposal."""
        proposal = self.d.history.proposal()
        approved = self.d.store.approval()
        if proposal is None:
            self.d.store.clear_approval()
            last = self.d.history.entries()[-1] if self.d.history.entries() else None
            self.d.decided(Phase.WATCHING, note=f"proposal settled: {last.outcome if last else 'gone'}")
            return
        if approved is None:
            return
        self.d.store.clear_approval()
        if approved != proposal.number:
            self.d.note(f"approval of entry {approved} ignored: the proposal waiting is entry {proposal.number}")
            return
        source = {**proposal.source, "approved": "by hand"}
        self.d.decided(Phase.PUBLISHING, note=f"publishing entry {proposal.number} (approved by hand)")
        self.submit(proposal.values, source, proposal)

    def canary(self) -> Canary:
        fp = self.d.fingerprint or (
            Fingerprint.from_json(self.d.state.tuned_fingerprint) if self.d.state.tuned_fingerprint else None
        )
        tokenizer = self.d.study.workload.tokenizer
        assert tokenizer is not None  # the staging study names one: checked when the daemon starts
        return production_canary(self.d.cfg, self.d.target, fp, tokenizer)

    def _publish(self, values: dict[str, Any], source: dict[str, Any], entry: Entry | None = None) -> Any:
        what = f"entry {entry.number}" if entry is not None else f"trial {source.get('trial')} of {source.get('study')}"

        def phase(p: str) -> None:
            if p == "verifying":
                self.d.enter(Phase.VERIFYING, note=f"{what} deployed; the canary runs")
            elif p == "rolling_back":
                self.d.enter(Phase.ROLLING_BACK, note=f"{what} failed; putting the last good config back")
            else:  # a blue/green switch's later steps: switching, watching production
                self.d.note(f"{what}: {p}")

        with PublishLock(self.d.root):
            return publish(
                self.d.target,
                values,
                self.d.history,
                self.canary(),
                source=source,
                entry=entry,
                on_phase=phase,
                verify=switch_verifier(self.d.cfg, self.d.target),
            )

    def done(self) -> None:
        job, self.job = self.job, None
        assert job is not None  # called once the publish's job is done (tick)
        try:
            result = job.result()
        except AutotuneError as e:  # the rollback failed too: say so everywhere, keep watching
            self.d.decided(Phase.WATCHING, note=f"PRODUCTION NEEDS A PERSON: {e}")
            self.d.history_metrics()
            self.d.metrics.last_publish.set(time.time())  # ended now
            return
        self.d.history_metrics()
        self.d.metrics.last_publish.set(time.time())  # ended now
        self.d.decided(
            Phase.WATCHING,
            note=f"entry {result.entry.number}: {result.outcome}"
            + (f" ({result.entry.reason})" if result.entry.reason else ""),
        )

    def _recovered(self, e: Entry) -> None:
        """Say what became of the publish a restart cut short, as the decision it is (``status`` shows it, not the
        "publishing" it replaces). An approved proposal that never reached production is proposed again: its
        approval was for a publish that did not happen, so a person approves it again."""
        said = f"recovered entry {e.number}: {e.outcome}" + (f" ({e.reason})" if e.reason else "")
        if e.outcome == "rolled-back" and not e.reached_production and e.source.get("approved") and self.d.cfg.approval:
            source = {k: v for k, v in e.source.items() if k != "approved"}
            again = self.d.history.add("proposed", e.values, source=source)
            self.d.decided(
                Phase.AWAITING_APPROVAL,
                note=f"{said}; it was approved but never served, so it waits "
                f"for `autotune publish --approve` again as entry {again.number}",
            )
            return
        self.d.decided(Phase.WATCHING, note=said)
