"""House rules of the repository itself: it speaks of itself alone.

Code and docs may point at other files of the repository (``docs/batching.md``,
``tests/unit/batching/test_rules.py``, ``rlbatch/batching/plan.py``) but never at files a user
does not have: a reference that resolves to no file of the repository fails here.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from conftest import REPO

# A path-looking token: optional directories, a name, a code or docs extension.
_PATH = re.compile(r"(?<![\w./-])((?:\.\./|\./)?(?:[\w.-]+/)*[\w-]+\.(?:md|py))\b")


def _sources() -> list[Path]:
    files = sorted((REPO / "launcher").rglob("*.py")) + sorted((REPO / "docs").glob("*.md"))
    return [*files, REPO / "README.md"]


def _repo_files() -> list[str]:
    """Tracked and not-ignored files (git knows what belongs to the repository)."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split()


def _resolves(ref: str, files: list[str]) -> bool:
    """Whether ``ref`` names a file of the repository, or is plainly not about the repository:
    a bare ``.py`` name or a path under a folder the repository does not have is a user's file
    in an example (``data.reward_fn=my_rewards.py:score``). A bare ``.md`` name is a docs page."""
    ref = ref.removeprefix("./")
    if ref.startswith("../"):
        return False
    if "/" not in ref:
        return ref.endswith(".py") or any(f.rsplit("/", 1)[-1] == ref for f in files)
    folders = {part for f in files for part in f.split("/")[:-1]}
    if ref.split("/", 1)[0] not in folders:
        return True
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
    assert _resolves("my_rewards.py", files)  # a user's file in an example
    assert not _resolves("../shared/design.md", files)
    assert not _resolves("batching/nowhere.py", files)
    assert not _resolves("docs/nowhere.md", files)
    assert not _resolves("design.md", files)


def test_test_files_have_unique_names():
    """The suite imports test modules by their base name (the tests' folders are not packages):
    two test files of one name stop the whole run at collection."""
    seen: dict[str, list[str]] = {}
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}
