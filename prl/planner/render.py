"""Plan -> the files of a run: the sbatch script, one step script per role, plan.json.

Templates in `templates/` only lay out what the plan holds (StrictUndefined, no
logic). Every value that reaches a shell goes through the `q` filter
(shlex.quote); values in `#SBATCH` lines were checked by the schema to hold no
spaces, quotes or '$'. Output is deterministic: same plan, same bytes.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import jinja2

from prl.planner.model import Plan

TEMPLATES_DIR = Path(__file__).resolve().parents[2] / "templates"
JOB_SCRIPT = "scripts/job.sbatch"


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES_DIR),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["q"] = lambda value: shlex.quote(str(value))
    return env


def render(plan: Plan, topology_yaml: str) -> dict[str, str]:
    """Relative path in the run directory -> file text."""
    env = _environment()
    context = {name: getattr(plan, name) for name in plan.__struct_fields__}
    files = {
        "topology.yaml": topology_yaml,
        "plan.json": plan.to_json(),
    }
    if plan.slurm:
        files[JOB_SCRIPT] = env.get_template("job.sbatch.j2").render(**context)
    step_template = env.get_template("step.sh.j2")
    for step in plan.steps:
        files[step.script] = step_template.render(step=step, **context)
    return files


def write(files: dict[str, str], run_dir: Path) -> list[Path]:
    """Write rendered files into the run directory, each atomically; scripts executable."""
    from prl.run.rundir import atomic_write_text

    written = []
    for rel, text in sorted(files.items()):
        path = run_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)
        if rel.endswith((".sh", ".sbatch")):
            path.chmod(0o755)
        written.append(path)
    return written
