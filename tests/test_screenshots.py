"""What a person reads first, as headless Chromium renders it: the report's verdict, a trial's note in
optuna-dashboard, and the screenshots of both (scripts/screenshots.py, which makes docs/*.png).

One small study against vllm-sim, made with the CLI (about a minute), feeds every test here. Chromium
is Debian's ``chromium``: scripts/ci_system_deps.sh installs it. Every process started here (the
study, optuna-dashboard, each Chromium) leads its own process group and is killed, group and all,
when it is done, whatever happens; everything is written under pytest's tmp paths.
"""

import importlib.util
import re
import struct
import sys
import urllib.error
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import optuna
import pytest

from autotune.study.records import StudyResult

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("screenshots", ROOT / "scripts" / "screenshots.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


shots = _script()


class _Text(HTMLParser):
    """The text a person sees (no scripts or styles), of the whole page or of the element with ``id``."""

    SKIP = {"script", "style", "noscript"}
    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}

    def __init__(self, id_=None):
        super().__init__()
        self.id, self.depth, self.skip, self.parts = id_, 0 if id_ else 1, 0, []

    def handle_starttag(self, tag, attrs):
        if tag in self.VOID:
            return
        if self.depth:
            self.depth += 1
        elif self.id is not None and dict(attrs).get("id") == self.id:
            self.depth = 1
        self.skip += tag in self.SKIP

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        self.skip -= tag in self.SKIP
        if self.depth and self.id is not None:
            self.depth -= 1
            if self.depth == 0:
                self.id = "done"  # the first element with that id only

    def handle_data(self, data):
        if self.depth and not self.skip:
            self.parts.append(data)


def text(page: str, id_: str | None = None) -> str:
    p = _Text(id_)
    p.feed(page)
    return re.sub(r"\s+", " ", " ".join(p.parts)).strip()


@pytest.fixture(scope="module")
def chromium():
    try:
        return shots.chromium()
    except shots.ChromiumMissing as e:
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def sim(chromium, tiny_model, tmp_path_factory):
    """The study (chromium is checked first: no minute of study for a test that cannot render it)."""
    return shots.sim_study(tmp_path_factory.mktemp("screens"), tiny_model)


@pytest.fixture(scope="module")
def result(sim):
    return StudyResult.of(optuna.load_study(study_name=sim.name, storage=sim.storage))


@pytest.fixture(scope="module")
def report(sim):
    return shots.write_report(sim, sim.file.parent / "report.html")


@pytest.fixture(scope="module")
def dash(sim):
    study_id = optuna.load_study(study_name=sim.name, storage=sim.storage)._study_id
    with shots.dashboard(sim.storage, sim.file.parent / "dashboard.log", sim.run_dir / "artifacts") as base:
        yield base, study_id


def test_the_reports_verdict_is_on_the_rendered_page(report, result, tmp_path):
    page = shots.dom(report, workdir=tmp_path)
    verdict = text(page, "verdict")
    assert verdict.startswith(("Winner:", "No configuration met")), verdict[:300]
    if result.winner is not None:
        assert verdict.startswith("Winner:") and f"trial {result.winner.number}" in verdict, verdict[:300]
    assert 'class="main-svg"' in page  # plotly's charts drew: the page's scripts ran
    # what the docs show holds no path of this machine: the engine's python is found on the PATH, the model
    # is models/tiny-llama beside the study (the storage URL in the footer, out of the picture, is the one)
    assert str(shots.ROOT) not in page and page.count(str(report.parent)) == 1, page.count(str(report.parent))


def test_a_trials_note_is_on_its_dashboard_page(dash, result, tmp_path):
    base, study_id = dash
    shown = result.winner or result.best_baseline
    assert shown is not None and shown.feasible
    page = text(shots.dom(shots.trial_url(base, study_id, shown.number), workdir=tmp_path))
    assert f"Trial {shown.number} " in page
    assert f"{shown.label}: meets every SLO" in page
    assert f"Capacity: {shown.capacity_rps:.2f} req/s, {shown.capacity_output_tok_s:.0f} output tok/s" in page

    # the oom baseline (70 % of an A10 leaves no room for a KV cache): its note names the class and the line
    # that proves it (the pre-check's, or vLLM's own when the engine found out at start-up)
    oom = next(r for r in result.records if r.baseline == "xinference-legacy")
    assert oom.failure_class == "oom" and oom.failure
    page = text(shots.dom(shots.trial_url(base, study_id, oom.number), workdir=tmp_path))
    assert "xinference-legacy: misses: oom" in page and "Failed: oom" in page and "proven by:" in page
    assert re.sub(r"\s+", " ", oom.failure).strip() in page

    # the study's note, on the study's Note page
    page = text(shots.dom(f"{base}/dashboard/studies/{study_id}/note", workdir=tmp_path))
    assert (f"Winner: trial {result.winner.number}" if result.winner else "No configuration met every SLO") in page


def _png_size(png: Path) -> tuple[int, int]:
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{png} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_the_screenshots_are_made(report, dash, tmp_path):
    base, study_id = dash
    png = shots.screenshot(report, tmp_path / "report.png", shots.REPORT_SIZE, workdir=tmp_path)
    assert _png_size(png) == shots.REPORT_SIZE and png.stat().st_size > 40_000
    png = shots.screenshot(shots.trial_url(base, study_id, 0), tmp_path / "trial.png", shots.TRIAL_SIZE,
                           workdir=tmp_path)
    assert _png_size(png) == shots.TRIAL_SIZE and png.stat().st_size > 40_000


def test_the_dashboard_is_stopped_whatever_happens(tmp_path, sim):
    with pytest.raises(RuntimeError, match="boom"):
        with shots.dashboard(sim.storage, tmp_path / "dashboard.log") as base:
            assert urllib.request.urlopen(base + "/api/meta", timeout=5).status == 200
            raise RuntimeError("boom")
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(base + "/api/meta", timeout=2)
