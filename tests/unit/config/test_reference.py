"""Every schema field is documented, and docs/configuration.md is current."""

from __future__ import annotations

from conftest import REPO
from rlbatch.config.reference import render_markdown, undocumented_fields


def test_every_field_has_a_docstring():
    assert undocumented_fields() == []


def test_configuration_page_is_current():
    page = (REPO / "docs" / "configuration.md").read_text()
    assert page == render_markdown(), (
        "regenerate: python -m rlbatch.config.reference > docs/configuration.md"
    )
