"""Docs that promise only what exists: scripts, compose services, examples that do not collide."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "shim" / "README.md"]


def test_every_script_the_docs_name_exists() -> None:
    named = {
        (doc.name, name)
        for doc in DOCS
        for name in re.findall(r"\bscripts/([A-Za-z0-9_]+)", doc.read_text())
    }
    missing = [
        (doc, name)
        for doc, name in sorted(named)
        if not (ROOT / "scripts" / name).exists() and not list((ROOT / "scripts").glob(f"{name}.*"))
    ]
    assert missing == []  # e.g. scripts/demo: not built (issue 17's Build section)


def test_the_readme_layout_names_every_compose_service() -> None:
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    layout = (ROOT / "README.md").read_text().split("## Layout", 1)[1]
    first, *rest = layout[layout.index("docker/ compose.yaml") :].split("\n")
    # The entry: its first line and the indented lines that continue it.
    entry = [first, *itertools.takewhile(lambda line: line.startswith(" " * 21), rest)]
    compose_line = " ".join(" ".join(entry).split())
    for name in services:
        base = re.sub(r"-gpu\d+$", "", name)  # dispatcher-gpu0 .. 7: "a dispatcher per GPU"
        said = {"postgres": "PostgreSQL", "redis": "Redis"}.get(base, base.replace("-", " "))
        assert said in compose_line, name


def _reserve_examples(doc: Path) -> dict[str, dict[str, object]]:
    """assignment_id -> request of each grpcurl Reserve example in `doc`."""
    found = {}
    for body in re.findall(
        r"-d '([^']*)'\s*\\?\s*\S+ gpuloom\.v1\.Dispatcher/Reserve", doc.read_text()
    ):
        request = json.loads(body)
        found[request["assignment_id"]] = request
    return found


def test_the_reserve_examples_of_readme_and_dispatcher_doc_use_distinct_ids() -> None:
    readme = _reserve_examples(ROOT / "README.md")
    dispatcher = _reserve_examples(ROOT / "docs" / "dispatcher.md")
    assert readme and dispatcher
    assert not readme.keys() & dispatcher.keys()


def _heading_anchors(doc: Path) -> set[str]:
    """The anchors GitHub makes of a Markdown file's headings (lower case, punctuation but `-`
    and `_` dropped, spaces as `-`), code blocks skipped."""
    anchors, fenced = set(), False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower())
            anchors.add(title.replace(" ", "-"))
    return anchors


def test_every_relative_link_of_the_docs_resolves() -> None:
    broken = []
    for doc in [*DOCS, ROOT / "protos" / "README.md"]:
        prose = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{doc.name}: {target}: no such file")
            elif anchor and file.suffix == ".md" and anchor not in _heading_anchors(file):
                broken.append(f"{doc.name}: {target}: no such heading")
    assert broken == []


def test_the_readme_stays_a_front_door() -> None:
    """What gpuloom is, the two commands, a short table of what runs, links: the detail lives
    in docs/, so the README stays short and no table cell grows into a page."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    cells = [cell for line in text.splitlines() if line.startswith("|") for cell in line.split("|")]
    assert max(len(cell) for cell in cells) <= 200
    assert "scripts/up" in text and "scripts/test" in text
