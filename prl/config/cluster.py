"""Cluster profiles (`clusters/*.yaml`): what a cluster offers and how it wants to be asked.

A profile is written once per cluster by whoever knows it (often the admins)
and named by topologies with `cluster: NAME` (a file in `clusters/`) or a path.
Only checks live here; `prl.planner.plan` derives everything else.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal, Optional, Sequence

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from prl.errors import ConfigError
from prl.config.loader import Source, load, shown, shown_path

REPO_ROOT = Path(__file__).resolve().parents[2]
CLUSTERS_DIR = REPO_ROOT / "clusters"

_TIME = re.compile(r"^([0-9]{1,3}-)?[0-9]{1,3}(:[0-9]{2}){0,2}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")
# C0/C1 controls, line separators and bidirectional overrides (text that reads other than it runs).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_SHELL_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")

MAX_NODES = 100_000
"""Most nodes any count may name (a typo of 10**12 stops at the schema)."""
MAX_GPUS_PER_NODE = 1024
MAX_CPUS = 65_536
MAX_GB = 10_000_000
MAX_ITEMS = 1000
"""Most items in a list or mapping field."""
MAX_TEXT = 4096
"""Longest string field."""


def check_printable(value: str) -> str:
    """No control characters (newlines, tabs, terminal escapes, bidi overrides) in a value for scripts or screens."""
    found = _CONTROL.search(value)
    if found:
        raise ValueError(f"must not contain control characters such as newlines, tabs or escapes "
                         f"(U+{ord(found.group()):04X} in {shown(value)})")
    return value


def check_shell_text(value: str) -> str:
    """Admin shell code may span lines and hold tabs, but no other control characters."""
    found = _SHELL_CONTROL.search(value)
    if found:
        raise ValueError(f"must not contain control characters other than newlines and tabs "
                         f"(U+{ord(found.group()):04X} in {shown(value)})")
    return value


Text = Annotated[str, Field(max_length=MAX_TEXT), AfterValidator(check_printable)]
"""A string of at most 4096 printable characters."""

Token = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^\s'\"`$;\\]+$"),
                  AfterValidator(check_printable)]
"""A value that lands in an #SBATCH line or an srun option: no spaces, quotes, '$', ';' or backslashes."""

Env = Annotated[dict[str, Text], Field(max_length=MAX_ITEMS)]
"""Environment variables: shell names to printable values."""


class Strict(BaseModel):
    # strict: YAML's `yes` is no number and "3" no int; no inf or nan in any float.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=False, strict=True,
                              allow_inf_nan=False)


def check_env_names(env: dict[str, str]) -> dict[str, str]:
    for name in env:
        if not _ENV_NAME.match(name):
            raise ValueError(f"environment variable name {shown(name)} is not a valid shell name")
    return env


def minutes_as_text(value: object) -> object:
    """`time: 30` in YAML is an int: Slurm reads a bare number as minutes, so accept it as such."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


def check_time(value: Optional[str]) -> Optional[str]:
    if value is not None and not _TIME.match(value):
        raise ValueError(f"time must look like MM, HH:MM:SS or D-HH:MM:SS, not {shown(value)}")
    return value


class NodeSpec(Strict):
    gpus: int = Field(ge=0, le=MAX_GPUS_PER_NODE)
    """GPUs on each node of this kind (0 for CPU-only nodes)."""
    cpus: int = Field(ge=1, le=MAX_CPUS)
    """CPU cores on each node that jobs may use."""
    memory_gb: float = Field(gt=0, le=MAX_GB)
    """Memory per node that jobs may use, in GiB."""


class Partitions(Strict):
    inference: Optional[Token] = None
    """Partition for inference groups (None: the cluster's default partition)."""
    trainer: Optional[Token] = None
    """Partition for the trainer group."""
    orchestrator: Optional[Token] = None
    """Partition for the orchestrator when it has nodes of its own (often a CPU partition)."""


class Container(Strict):
    image: Token
    """Container image for every step (pyxis `--container-image`)."""
    mounts: list[Token] = Field(default=[], max_length=MAX_ITEMS)
    """`SRC:DST[:FLAGS]` mounts (pyxis `--container-mounts`); the run directory's root is added."""
    workdir: Optional[Token] = None
    """Working directory inside the container."""


class Network(Strict):
    interface: Optional[Token] = None
    """Interface the roles bind to and talk over (None: the node's hostname address)."""
    env: Env = {}
    """Variables for the fabric: NCCL_*, UCX_*, FI_* and so on."""

    _names = field_validator("env")(check_env_names)


class Requeue(Strict):
    enabled: bool = False
    """Let Slurm requeue the job on node failure or preemption (`--requeue`)."""
    signal_seconds: int = Field(default=120, ge=0, le=65535)
    """Seconds before the time limit that the batch shell gets SIGTERM to checkpoint (0: none)."""
    grace_seconds: int = Field(default=60, ge=0, le=86400)
    """Seconds the roles get to finish a checkpoint after a stop, before they are killed."""


class ClusterProfile(Strict):
    name: str = Field(max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """Profile name, shown in plans and errors."""
    slurm: bool = True
    """False for the local profile: roles run as local processes, no Slurm."""
    hetjob: bool = True
    """Whether heterogeneous jobs are allowed; if not, one allocation with roles placed by node ranges."""
    partitions: Partitions = Partitions()
    account: Optional[Token] = None
    """`--account` for every job."""
    qos: Optional[Token] = None
    """Default `--qos` (a topology's `slurm.qos` wins)."""
    gpu_node: NodeSpec
    """What a GPU node offers (used by inference and trainer groups)."""
    cpu_node: Optional[NodeSpec] = None
    """What a node of the orchestrator partition offers (None: same as gpu_node)."""
    gpu_directive: Literal["gpus-per-node", "gres", "none"] = "gpus-per-node"
    """How GPUs are requested: `--gpus-per-node=N`, `--gres=gpu:N`, or not at all (whole-node clusters)."""
    gres_name: str = Field(default="gpu", max_length=256, pattern=r"^[A-Za-z0-9_:.-]+$")
    """GRES name for the `gres` directive (e.g. `gpu` or `gpu:h100`)."""
    exclusive: bool = True
    """Ask for whole nodes (`--exclusive`)."""
    segment: Optional[int] = Field(default=None, ge=1, le=MAX_NODES)
    """`--segment` size for block/topology-aware placement (Slurm 23.11+)."""
    constraint: Optional[Token] = None
    """`--constraint` feature expression."""
    container: Optional[Container] = None
    """Run every step in a pyxis container."""
    modules: list[Text] = Field(default=[], max_length=MAX_ITEMS)
    """Environment modules loaded before the roles start (`module load NAME`)."""
    venv: Optional[Text] = None
    """A Python virtual environment activated before the roles start."""
    setup: list[Annotated[str, Field(max_length=16 * MAX_TEXT), AfterValidator(check_shell_text)]] = Field(
        default=[], max_length=MAX_ITEMS)
    """Shell lines run before the roles start. Cluster-admin shell code, rendered verbatim:
    the one field that is shell by contract (topology values never are)."""
    python: Text = Field(default="python3", min_length=1)
    """Interpreter that runs prl on compute nodes."""
    env: Env = {}
    """Variables exported to every role."""
    shared_root: Text = Field(min_length=1)
    """Root of the shared filesystem every node sees (run directories belong under it)."""
    network: Network = Network()
    max_nodes: int = Field(ge=1, le=MAX_NODES)
    """Most nodes one job may use."""
    default_time: Optional[str] = None
    """Time limit when the topology gives none."""
    requeue: Requeue = Requeue()
    port_base: int = Field(default=8000, ge=1024, le=65000)
    """First port the roles' servers use on a node."""
    single_host: bool = False
    """Every node is the same host (several `slurmd -N` on one machine, a test cluster): servers get
    ports distinct job-wide, as in local runs, instead of the same ports on each node."""

    _names = field_validator("env")(check_env_names)
    _time_in = field_validator("default_time", mode="before")(minutes_as_text)
    _time = field_validator("default_time")(check_time)

    @property
    def orchestrator_node(self) -> NodeSpec:
        return self.cpu_node or self.gpu_node


def profile_path(name_or_path: str, relative_to: Path) -> Path:
    """`lab` -> clusters/lab.yaml; anything with a slash or .yaml is a path."""
    if "/" in name_or_path or name_or_path.endswith((".yaml", ".yml")):
        path = Path(name_or_path)
        return path if path.is_absolute() else relative_to / path
    return CLUSTERS_DIR / f"{name_or_path}.yaml"


def load_profile(name_or_path: str, relative_to: Path, overrides: Sequence[str] = ()) -> tuple[ClusterProfile, Source]:
    path = profile_path(name_or_path, relative_to)
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in CLUSTERS_DIR.glob("*.yaml")))
        raise ConfigError(f"cluster profile {shown(name_or_path)} not found ({shown_path(path)}); "
                          f"shipped profiles: {known}")
    return load(ClusterProfile, path, overrides)
