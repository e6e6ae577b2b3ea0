"""Plan -> the files of a run: the sbatch script, one launch script per role, plan.json.

Templates in `templates/` only lay out what the plan holds (StrictUndefined, no
logic). Every value that reaches a shell goes through the `q` filter
(shlex.quote), or `env_value` for `env:` values that read the node's environment; values in `#SBATCH` lines were checked by the schema to hold no
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
    env.filters["env_value"] = env_value
    return env


def env_value(value: str) -> str:
    """An `env:` value as shell text: literal parts quoted, each `${oc.env:NAME[,default]}` reference
    (kept by the loader so no secret is written) expanded by the shell where the role runs."""
    from prl.config.loader import ENV_REFERENCE, reference_default

    parts, end = [], 0
    for ref in ENV_REFERENCE.finditer(value):
        if ref.start() > end:
            parts.append(shlex.quote(value[end:ref.start()]))
        # The default holds nothing the shell would expand inside double quotes (the loader checks).
        name, default = ref.group(1), reference_default(ref)
        parts.append(f'"${{{name}?is not set where this role runs}}"' if default is None else f'"${{{name}-{default}}}"')
        end = ref.end()
    if end < len(value) or not parts:
        parts.append(shlex.quote(value[end:]))
    return "".join(parts)


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
    launch_template = env.get_template("launch.sh.j2")
    for launch in plan.launches:
        files[launch.script] = launch_template.render(launch=launch, **context)
    return files


def write(files: dict[str, str], run_dir: Path) -> list[Path]:
    """Write rendered files into the run directory, each atomically and private to its owner
    (scripts 0700, the rest 0600, in a 0700 run directory)."""
    from prl.run.rundir import DIR_MODE, atomic_write_text

    run_dir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    run_dir.chmod(DIR_MODE)
    written = []
    for rel, text in sorted(files.items()):
        path = run_dir / rel
        path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        atomic_write_text(path, text, 0o700 if rel.endswith((".sh", ".sbatch")) else 0o600)
        written.append(path)
    return written
