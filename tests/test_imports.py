"""The control plane must not import the heavy runtime stacks: login nodes are slow."""

import subprocess
import sys

HEAVY = ("torch", "vllm", "transformers", "verifiers", "safetensors", "numpy")
CONTROL_PLANE = ("prl.cli", "prl.planner.prepare", "prl.planner.plan", "prl.planner.render", "prl.planner.show", "prl.run.rundir", "prl.ops.submit",
                 "prl.ops.status", "prl.ops.logs", "prl.ops.registry", "prl.ops.slurm", "prl.job.launch", "prl.job.role", "prl.job.doctor",
                 "prl.run.batch", "prl.inference", "prl.orchestrator", "prl.trainer")


def test_control_plane_imports_nothing_heavy():
    code = (
        "import sys\n"
        f"for m in {CONTROL_PLANE!r}:\n"
        "    __import__(m)\n"
        f"print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"control plane imported: {out.stdout}"


def test_plan_command_imports_nothing_heavy(tmp_path):
    """Run `prl plan` in-process and look at sys.modules afterwards."""
    code = (
        "import sys\n"
        "from prl.cli import app\n"
        "app(['plan', 'configs/moe-1t.yaml', '--no-write'], standalone_mode=False)\n"
        f"print('HEAVY:' + ' '.join(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=str(__import__("pathlib").Path(__file__).parent.parent))
    assert "HEAVY:\n" in out.stdout or out.stdout.rstrip().endswith("HEAVY:"), out.stdout[-500:]
