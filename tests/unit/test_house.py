"""House rules of the repository itself: it speaks of itself alone.

Code and docs may point at other files of the repository (``docs/batching.md``,
``tests/unit/batching/test_rules.py``, ``rlbatch/batching/plan.py``) but never at files a user
does not have: a reference that resolves to no file of the repository fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO

# A path-looking token: optional directories, a name, a code or docs extension.
_PATH = re.compile(r"(?<![\w./-])((?:\.\./|\./)?(?:[\w.-]+/)*[\w-]+\.(?:md|py))\b")
# Names the repository uses for files it writes or reads at run time, not files of its own.
_RUNTIME_NAMES = {"setup.py", "conftest.py", "__init__.py", "__main__.py"}


def _sources() -> list[Path]:
    files = sorted((REPO / "launcher").rglob("*.py")) + sorted((REPO / "docs").glob("*.md"))
    return [*files, REPO / "README.md"]


def _repo_files() -> list[str]:
    skip = {".git", ".venv", "outputs", "multirun", "build", "dist"}  # top-level folders only
    return [
        p.relative_to(REPO).as_posix()
        for p in REPO.rglob("*")
        if p.is_file() and p.relative_to(REPO).parts[0] not in skip and "__pycache__" not in p.parts
    ]


def _resolves(ref: str, files: list[str]) -> bool:
    ref = ref.removeprefix("./")
    if ref.startswith("../"):
        return False
    if "/" not in ref:
        return ref in _RUNTIME_NAMES or any(f.rsplit("/", 1)[-1] == ref for f in files)
    return any(f == ref or f.endswith("/" + ref) for f in files)


def test_every_file_named_in_code_and_docs_exists_in_the_repository():
    files = _repo_files()
    missing = []
    for source in _sources():
        for n, line in enumerate(source.read_text().splitlines(), 1):
            for ref in _PATH.findall(line):
                if not _resolves(ref, files):
                    missing.append(f"{source.relative_to(REPO)}:{n}: {ref}")
    assert missing == [], "references to files that are not in the repository:\n" + "\n".join(
        missing
    )


def test_no_reference_to_the_private_design_notes():
    pattern = re.compile(r"design\.md|megatron-cpu\.md|\bseeds?\s+00[0-9]\b|shared/", re.I)
    hits = [
        f"{source.relative_to(REPO)}:{n}"
        for source in _sources()
        for n, line in enumerate(source.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert hits == []


def test_the_checker_catches_a_missing_file():
    files = ["docs/batching.md", "launcher/rlbatch/batching/plan.py"]
    assert _resolves("docs/batching.md", files)
    assert _resolves("rlbatch/batching/plan.py", files)
    assert _resolves("plan.py", files)
    assert not _resolves("../shared/design.md", files)
    assert not _resolves("docs/nowhere.md", files)
    assert not _resolves("design.md", files)
