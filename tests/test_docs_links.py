"""The README and the docs link only to files that exist, and the README stays short enough to finish.

Sections moved out of the README into docs/ and bench/ change what a relative link is relative to;
a link that still points where the text used to live is caught here, naming the file and the link.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "bench").glob("*.md"))]
README_MAX_LINES = 250  # issue 27: a README a newcomer reads to the end; the rest lives in docs/

LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # [text](target "title")
CODE = re.compile(r"^```.*?^```|`[^`\n]*`", re.DOTALL | re.MULTILINE)  # code is text, not links


def broken_links(md: Path) -> list[str]:
    """The relative link targets in ``md`` that name no file or folder, as written."""
    text = CODE.sub("", md.read_text(encoding="utf-8"))
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # http(s), mailto: not ours to check; a pure #anchor is within the file
        path = target.split("#", 1)[0]
        if not (md.parent / path).exists():
            broken.append(target)
    return broken


@pytest.mark.parametrize("md", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(md):
    assert broken_links(md) == [], f"{md.relative_to(ROOT)} links to files that do not exist"


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines, more than {README_MAX_LINES}: move a section to docs/"


def test_a_broken_link_is_caught(tmp_path):
    # The checker itself must see a moved file's stale link, or the tests above pass vacuously.
    (tmp_path / "real.png").touch()
    md = tmp_path / "x.md"
    md.write_text("![ok](real.png) [stale](docs/real.png#top) [web](https://x.org) [here](#a) `[code](nope)`\n")
    assert broken_links(md) == ["docs/real.png#top"]
