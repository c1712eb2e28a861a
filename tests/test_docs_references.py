"""The documentation cites only files the repository has: every relative link, and every `*.md` file named."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md",
         ROOT / "bench" / "RESULTS.md"]  # fmt: skip
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
NAMED_FILE = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.(?:md|txt))\b")


def exists(page: Path, target: str) -> bool:
    return (page.parent / target).exists() or (ROOT / target).exists()


def test_every_relative_link_and_named_document_exists() -> None:
    missing = []
    for page in PAGES:
        text = page.read_text()
        targets = [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)] + NAMED_FILE.findall(text)
        missing += [f"{page.relative_to(ROOT)}: {target}" for target in targets if not exists(page, target)]
    assert missing == []


def test_no_page_cites_the_design_notes_or_the_seed_file_outside_the_repository() -> None:
    for page in PAGES:
        text = page.read_text()
        assert "DESIGN.md" not in text and "seeds/" not in text, page
