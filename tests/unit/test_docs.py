"""The docs a newcomer reads stay true to the code: the daemon's flag table is
the one its settings declare, the module map names every module where it
lives, and every relative link in README.md and docs/ resolves to a file (and
an anchor of it, when it names one)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from ec_daemon.serving.config import markdown_table

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
PACKAGES = ("ec_protocol", "ec_daemon", "ec_client")
# [text](target): the target up to whitespace or ')'; code spans are left out first.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def test_the_running_guide_documents_every_daemon_flag_with_its_default():
    assert markdown_table() in (ROOT / "docs" / "running.md").read_text(), \
        "docs/running.md's flag table differs: python -m ec_daemon.serving.config prints it"


def test_the_flag_table_has_a_row_per_setting():
    from ec_daemon.serving.config import SETTINGS

    rows = markdown_table().splitlines()[2:]
    assert len(rows) == len(SETTINGS)
    assert any(row.startswith("| `--check-invariants BOOL` |") for row in rows)


def _module_map() -> set[tuple[str, str]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    listed: set[tuple[str, str]] = set()
    package = ""
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 3 or cells[0] in ("package", "---"):
            continue
        named = re.findall(r"`([^`]+)`", cells[0])
        package = named[0] if named else package
        for module in re.findall(r"`([^`]+)`", cells[1]):
            assert (package, module) not in listed, f"{package}.{module} is listed twice"
            listed.add((package, module))
    return listed


def _modules() -> set[tuple[str, str]]:
    found = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if "_proto" in parts or parts[-1] == "__init__":
                continue
            found.add((".".join(parts[:-1]), parts[-1]))
    return found


def test_the_module_map_names_every_module_under_its_own_package():
    listed, found = _module_map(), _modules()
    missing = sorted(".".join(m) for m in found - listed)
    stale = sorted(".".join(m) for m in listed - found)
    assert not missing, f"docs/architecture.md's module map lacks {missing}"
    assert not stale, f"docs/architecture.md's module map names what does not exist: {stale}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def _links(path: Path) -> list[str]:
    return LINK.findall(CODE.sub("", path.read_text()))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path):
    broken = []
    for target in _links(doc):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:: not checked here
            continue
        file, _, anchor = target.partition("#")
        linked = (doc.parent / file).resolve() if file else doc
        if not linked.exists() or ROOT not in linked.parents:
            broken.append(f"{target} (no such file in the repository)")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target} (no heading #{anchor} in {linked.name})")
    assert not broken, f"{doc.relative_to(ROOT)}: broken links {broken}"


def test_the_readme_is_short_and_links_every_guide():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    guides = {p.name for p in (ROOT / "docs").glob("*.md")}
    linked = {Path(t.partition("#")[0]).name for t in _links(ROOT / "README.md")}
    assert guides <= linked, f"README.md does not link {sorted(guides - linked)}"


def test_make_help_lists_every_target_with_a_line():
    makefile = (ROOT / "Makefile").read_text()
    targets = re.findall(r"^([a-z][a-z0-9-]*):(?!=)", makefile, flags=re.M)
    undocumented = [t for t in targets
                    if not re.search(rf"^## \S.*\n{re.escape(t)}:(?!=)", makefile, flags=re.M)]
    assert not undocumented, f"Makefile targets without a `## ` line above them: {undocumented}"
    shown = subprocess.run(["make", "-s", "--no-print-directory", "help"], cwd=ROOT,
                           capture_output=True, text=True, check=True, timeout=60).stdout
    listed = [line.split()[0] for line in shown.splitlines()]
    assert sorted(listed) == sorted(set(targets))


# A socket a doc names is the daemon's default or the systemd unit's path, and
# the doc says which (in its paragraph or code block, or the paragraph that
# introduces the block): a reader copying a command knows where it points.
SOCKET = re.compile(r"(?:unix://)?(?:\$\w+|/)[\w$./-]*\.sock\b")
DEFAULT_SOCKETS = re.compile(r"(\$XDG_RUNTIME_DIR|/run/user/\d+)/ec-daemon/ec\.sock"
                             r"|/tmp/ec-daemon-\$UID/ec\.sock")  # (/run/user/1000: an example)
SYSTEMD_SOCKET = "/run/ec-daemon/ec.sock"


def _blocks(text: str) -> list[str]:
    """Paragraphs and fenced code blocks, in order."""
    blocks, current, fenced = [], [], False
    for line in text.splitlines():
        if line.startswith("```"):
            if not fenced and current:
                blocks.append("\n".join(current))
                current = []
            current.append(line)
            fenced = not fenced
            if not fenced:
                blocks.append("\n".join(current))
                current = []
        elif fenced or line.strip():
            current.append(line)
        elif current:
            blocks.append("\n".join(current))
            current = []
    return [*blocks, "\n".join(current)] if current else blocks


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_socket_a_doc_names_is_the_default_or_systemds_and_says_which(doc: Path):
    wrong = []
    blocks = _blocks(doc.read_text())
    for i, block in enumerate(blocks):
        context = (blocks[i - 1] + "\n" + block if i else block).lower()
        for found in SOCKET.findall(block):
            path = found.removeprefix("unix://")
            if path == SYSTEMD_SOCKET:
                said = "systemd" in context
            elif DEFAULT_SOCKETS.fullmatch(path):
                said = "default" in context
            else:
                wrong.append(f"{found} (neither the daemon's default nor {SYSTEMD_SOCKET})")
                continue
            if not said:
                whose = "the systemd unit's" if path == SYSTEMD_SOCKET else "the default"
                wrong.append(f"{found} (its paragraph does not say it is {whose})")
    assert not wrong, f"{doc.relative_to(ROOT)}: {wrong}"


def glossary_terms(text: str) -> list[str]:
    """The glossary's terms, as its first column names them, a qualifier in
    parentheses dropped ("claim (of an item)" is the term "claim")."""
    rows = [line for line in text.splitlines() if line.startswith("| ")][1:]  # (its header)
    return [re.sub(r"\s*\(.*\)\s*$", "", row.split("|")[1]).strip() for row in rows]


def test_the_glossary_defines_each_term_once():
    terms = glossary_terms((ROOT / "docs" / "glossary.md").read_text())
    assert len(terms) > 30
    assert sorted(t for t in set(terms) if terms.count(t) > 1) == []


def test_the_glossary_check_sees_a_term_defined_twice():
    text = ("| term | meaning |\n|---|---|\n| claim (in a view) | a |\n"
            "| claim (of an item) | b |\n| hold | c |\n")
    assert glossary_terms(text) == ["claim", "claim", "hold"]
