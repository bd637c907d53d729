"""Why an engine failed, read from what it printed and how it exited.

An engine kind supplies the texts that prove each FailureClass (``EngineKind.failure_patterns``,
e.g. engine/vllm/failures.py); the launch spec carries them to the launcher, which feeds
every log line, from either stream, to a ``LogWatch``. The first line that proves a class is
kept together with the lines around it, so the trial records why, not just that.
"""

from __future__ import annotations

import collections
import enum
import re
import signal
from dataclasses import dataclass, field

__all__ = ["FailureClass", "Failure", "LogWatch", "classify_exit", "COMMON_PATTERNS", "Patterns"]


class FailureClass(str, enum.Enum):
    INVALID_ARGS = "invalid-args"  # a bug in the space or the user's args: fail loudly
    OOM = "oom"  # the config does not fit in memory: prune and teach the sampler
    PORT_IN_USE = "port-in-use"  # our side: another process holds the port
    STARTUP_TIMEOUT = "startup-timeout"  # never became healthy in time
    CRASHED = "crashed"  # exited for another reason, before or after becoming ready


Patterns = list[tuple["FailureClass", re.Pattern[str]]]

# Every engine's: the port was taken between our check and its bind.
COMMON_PATTERNS: Patterns = [
    (FailureClass.PORT_IN_USE, re.compile(p)) for p in (r"\[Errno 98\]", r"[Aa]ddress already in use")
]

EXCERPT_BEFORE = 12  # lines of context kept before the line that proves the class
EXCERPT_AFTER = 6  # and after it (a pydantic error names the field on the next lines)
# A header that only announces the proof: a more specific line of the same class may follow.
_HEADERS = re.compile(r"validation errors? for \w+")
# An exception's own line, where no pattern names the class: the cause a crash shows. vLLM's engine core and its
# workers print theirs behind "(EngineCore pid=N) ERROR" or "(VllmWorker-0 pid=N) ERROR"; its API server ends
# with a generic line that only points back to it.
_RAISED = re.compile(r"\b[A-Z]\w*(?:Error|Exception): \S")
_POINTS_BACK = re.compile(r"See root cause above|Engine core initialization failed")


@dataclass(frozen=True)
class Failure:
    failure_class: FailureClass
    summary: str  # the line that proves it (or how it exited)
    excerpt: str = ""  # that line with the lines before it
    exit_code: int | None = None
    detected_at: float | None = None  # time.monotonic() when the launcher knew

    def to_json(self) -> dict[str, object]:
        return {
            "class": self.failure_class.value,
            "summary": self.summary,
            "excerpt": self.excerpt,
            "exit_code": self.exit_code,
        }


@dataclass
class LogWatch:
    """Reads log lines as they come and remembers the first one that proves a failure.

    ``found`` is (class, proving line, excerpt); the excerpt keeps growing with the lines that
    follow the proof, up to EXCERPT_AFTER of them.
    """

    patterns: Patterns = field(default_factory=lambda: list(COMMON_PATTERNS))  # most specific first
    recent: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=200))
    found: tuple[FailureClass, str, str] | None = None
    _after: int = 0

    def feed(self, line: str) -> tuple[FailureClass, str] | None:
        line = line.rstrip("\n")
        self.recent.append(line)
        if self.found is not None:
            if self._after < EXCERPT_AFTER:
                self._after += 1
                cls, proof, excerpt = self.found
                if _HEADERS.search(proof) and self._classify(line) is cls and not _HEADERS.search(line):
                    proof = line.strip()  # the specific line beats its header
                self.found = (cls, proof, excerpt + "\n" + line)
            return None
        proved = self._classify(line)
        if proved is not None:
            before = list(self.recent)[-(EXCERPT_BEFORE + 1) :]
            self.found = (proved, line.strip(), "\n".join(before))
            return proved, line
        return None

    def _classify(self, line: str) -> FailureClass | None:
        for cls, pat in self.patterns:
            if pat.search(line):
                return cls
        return None

    def tail(self, n: int = 30) -> str:
        return "\n".join(list(self.recent)[-n:])

    def root_cause(self) -> str | None:
        """The first exception line among the recent ones that is not a pointer back to another (None: none)."""
        return next((x.strip() for x in self.recent if _RAISED.search(x) and not _POINTS_BACK.search(x)), None)


def classify_exit(returncode: int, watch: LogWatch) -> Failure:
    """Classify an engine that exited on its own, with code ``returncode``."""
    if watch.found is not None:
        cls, line, excerpt = watch.found
        return Failure(cls, line, excerpt, returncode)
    if returncode == 2:  # argparse's exit code: vLLM rejected its command line
        return Failure(FailureClass.INVALID_ARGS, "exited with code 2 (usage error)", watch.tail(), returncode)
    if returncode in (-signal.SIGKILL, 128 + signal.SIGKILL):
        # No traceback and a SIGKILL we did not send: the host's OOM killer, nearly always.
        return Failure(
            FailureClass.OOM, "killed by SIGKILL with no traceback (host out of memory?)", watch.tail(), returncode
        )
    cause = watch.root_cause()
    said = f"exited with code {returncode}" + (f": {cause}" if cause else "")
    return Failure(FailureClass.CRASHED, said, watch.tail(), returncode)
