"""Docs that are generated must be current; docs that name commands must name real ones."""

from tests.helpers import REPO
from prl.config.schema_doc import reference


def test_field_reference_is_current():
    current = (REPO / "docs" / "reference.md").read_text()
    assert current == reference(), "docs/reference.md is stale: python -m prl.config.schema_doc > docs/reference.md"


def test_readme_test_command_is_what_ci_runs():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert "./scripts/test.sh" in readme and "exec ./scripts/test.sh" in ci
