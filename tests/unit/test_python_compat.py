"""The code runs on every Python that pyproject claims (3.11 to 3.13): no syntax newer than the
oldest, no import of a standard-library module that 3.12 or 3.13 removed. CI runs the suite on
3.11; tests/e2e/test_python_versions.py checks that the dependencies resolve on 3.12 and 3.13."""

from __future__ import annotations

import ast
import tomllib

import pytest
from packaging.specifiers import SpecifierSet

from conftest import REPO

OLDEST = (3, 11)
REMOVED = {
    # 3.12 (PEP 594 / 632)
    "distutils", "imp", "asynchat", "asyncore", "smtpd",
    # 3.13 (PEP 594)
    "aifc", "audioop", "cgi", "cgitb", "chunk", "crypt", "imghdr", "mailcap", "msilib", "nis",
    "nntplib", "ossaudiodev", "pipes", "sndhdr", "spwd", "sunau", "telnetlib", "uu", "xdrlib",
    "lib2to3",
}  # fmt: skip


def _sources() -> list:
    roots = [REPO / "launcher", REPO / "tests", REPO / "examples"]
    return sorted(p for root in roots for p in root.rglob("*.py"))


def _imported(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_requires_python_claims_3_11_to_3_13():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    spec = SpecifierSet(project["requires-python"])
    assert all(v in spec for v in ("3.11", "3.12", "3.13")), spec
    assert "3.10" not in spec, "3.10 is neither tested nor resolved: do not claim it"
    classifiers = {c.rsplit(" ", 1)[-1] for c in project["classifiers"] if "Python :: 3." in c}
    assert classifiers == {"3.11", "3.12", "3.13"}


def test_sources_parse_at_the_oldest_python_and_import_nothing_removed():
    files = _sources()
    assert len(files) > 100
    offenders = []
    for path in files:
        try:
            tree = ast.parse(path.read_text(), str(path), feature_version=OLDEST)
        except SyntaxError as exc:  # pragma: no cover - the failure message is the point
            pytest.fail(f"{path}: not Python {OLDEST[0]}.{OLDEST[1]} syntax: {exc}")
        offenders += [f"{path.relative_to(REPO)}: {m}" for m in sorted(_imported(tree) & REMOVED)]
    assert not offenders, offenders
