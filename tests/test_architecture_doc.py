"""docs/architecture.md and the package indexes say what the code is: checked where a test can check it (the layer
picture is checked in tests/test_imports.py, the entry points in tests/test_error_contract.py)."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import msgspec

from prl.run import api, records

REPO = Path(__file__).resolve().parents[1]
ARCHITECTURE = (REPO / "docs" / "architecture.md").read_text()


def section(title: str) -> str:
    """The text of one `## title` section of docs/architecture.md."""
    start = ARCHITECTURE.index(f"## {title}")
    end = ARCHITECTURE.find("\n## ", start + 1)
    return ARCHITECTURE[start:end if end > 0 else None]


def structs(module) -> set[str]:
    return {name for name, obj in vars(module).items() if inspect.isclass(obj) and issubclass(obj, msgspec.Struct)
            and obj.__module__ == module.__name__ and not name.startswith("_")}


def test_the_record_list_names_every_record_of_the_run_directory_and_nothing_else():
    table = section("The run directory's records")
    named = set(re.findall(r"`([A-Z][A-Za-z]+)`", table))
    files = {name for name in structs(records) if issubclass(getattr(records, name), records.Record)} - {"Record"}
    parts = structs(records) - files - {"Record"}  # what a record holds (a launch, a failure, a check)
    missing = (files | parts) - named
    assert not missing, f"docs/architecture.md's record list does not name {sorted(missing)}"
    stale = {n for n in named if n.endswith(("Record", "Marker", "Exit", "Beat", "Report", "Request", "Answer",
                                             "Cursor", "Pin", "Failure"))} - structs(records) - structs(api)
    assert not stale, f"docs/architecture.md names records that do not exist: {sorted(stale)}"


def test_the_record_list_names_every_http_body_of_prl_s_routes():
    named = set(re.findall(r"`([A-Z][A-Za-z]+)`", section("The run directory's records")))
    bodies = structs(api) - {"Body"}
    assert bodies <= named, f"docs/architecture.md does not name the HTTP bodies {sorted(bodies - named)}"


def index_of(package: Path) -> str:
    return ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""


def test_every_package_index_lists_its_modules_and_only_those():
    """Each package's docstring is its index: a line per module (`name.py  what it does`)."""
    for package in sorted(p for p in (REPO / "prl").iterdir() if (p / "__init__.py").is_file()):
        modules = {p.name for p in package.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
        listed = set(re.findall(r"^\s*([a-z_0-9]+\.py)\b", index_of(package), re.M))
        assert listed == modules, (f"{package.relative_to(REPO)}/__init__.py's index: missing {sorted(modules - listed)}, "
                                   f"stale {sorted(listed - modules)}")


def test_the_heartbeat_the_topology_reference_names_is_the_one_defined():
    from prl.run.rundir import HEARTBEAT_S

    reference = (REPO / "docs" / "reference.md").read_text()
    assert f"heartbeats every {HEARTBEAT_S:g} s (`HEARTBEAT_S`" in reference
