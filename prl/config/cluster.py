"""Cluster profiles (`clusters/*.yaml`): what a cluster offers and how it wants to be asked.

A profile is written once per cluster by whoever knows it (often the admins)
and named by topologies with `cluster: NAME` (a file in `clusters/`) or a path.
Only checks live here; `prl.planner.plan` derives everything else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional, Sequence

from msgspec import Meta

from prl.errors import ConfigError
from prl.config.fields import FieldValueError, shown, shown_path
from prl.config.loader import Source, explained, load
from prl.config.types import (MAX_CPUS, MAX_GB, MAX_GPUS_PER_NODE, MAX_ITEMS, MAX_NODES, Env, Name, NonEmptyText,
                              PathText, PathToken, ShellLine, SlurmTime, Strict, Text, Token, checked_time)

REPO_ROOT = Path(__file__).resolve().parents[2]
CLUSTERS_DIR = REPO_ROOT / "clusters"


class NodeSpec(Strict, kw_only=True):
    gpus: Annotated[int, Meta(ge=0, le=MAX_GPUS_PER_NODE)]
    """GPUs on each node of this kind (0 for CPU-only nodes)."""
    cpus: Annotated[int, Meta(ge=1, le=MAX_CPUS)]
    """CPU cores on each node that jobs may use."""
    memory_gb: Annotated[float, Meta(gt=0, le=MAX_GB)]
    """Memory per node that jobs may use, in GiB."""
    gpu_memory_gb: Optional[Annotated[float, Meta(gt=0, le=MAX_GB)]] = None
    """Memory of each GPU, in GiB (None: not said; the planner then cannot check what a GPU must hold beside
    vLLM's share, e.g. a weight update's receive buffers under `weights.backend: nccl`)."""
    fp8: bool = False
    """The GPUs multiply in FP8 (compute capability 8.9+: H100, H200, L40S, B200; not A100 or V100):
    `trainer.precision: fp8` and `inference.quantization: fp8` need it."""


class Partitions(Strict, kw_only=True):
    inference: Optional[Token] = None
    """Partition for inference groups (None: the cluster's default partition)."""
    trainer: Optional[Token] = None
    """Partition for the trainer group."""
    orchestrator: Optional[Token] = None
    """Partition for the orchestrator when it has nodes of its own (often a CPU partition)."""


class Container(Strict, kw_only=True):
    image: Token
    """Container image for every step (pyxis `--container-image`)."""
    mounts: Annotated[list[PathToken], Meta(max_length=MAX_ITEMS)] = []
    """`SRC:DST[:FLAGS]` mounts (pyxis `--container-mounts`), one per item; the run directory's root is added."""
    workdir: Optional[PathToken] = None
    """Working directory inside the container."""

    def __post_init__(self) -> None:
        for index, mount in enumerate(self.mounts):
            # pyxis splits --container-mounts at ',' and each mount at ':': more would add mounts or flags.
            if "," in mount or mount.count(":") > 2:
                raise FieldValueError("mounts", f"mounts[{index}] {shown(mount)} must be one SRC:DST[:FLAGS] mount: "
                                                f"pyxis reads ',' as another mount and ':' as a separator")


class Network(Strict, kw_only=True):
    interface: Optional[Token] = None
    """Interface the roles bind to and talk over (None: the node's hostname address)."""
    env: Env = {}
    """Variables for the fabric: NCCL_*, UCX_*, FI_* and so on."""


class Requeue(Strict, kw_only=True):
    enabled: bool = False
    """Let Slurm requeue the job on node failure or preemption (`--requeue`)."""
    signal_seconds: Annotated[int, Meta(ge=0, le=65535)] = 120
    """Seconds before the time limit that the batch shell gets SIGTERM to checkpoint (0: none)."""
    grace_seconds: Annotated[int, Meta(ge=0, le=86400)] = 60
    """Seconds the roles get to finish a checkpoint after a stop, before they are killed."""


def _gres_name(value: str) -> str:
    return "must use only letters, digits, '_', ':', '.' and '-'"


class ClusterProfile(Strict, kw_only=True):
    name: Name
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
    gres_name: Annotated[str, Meta(max_length=256), explained(r"\A[A-Za-z0-9_:.-]+\Z", _gres_name)] = "gpu"
    """GRES name for the `gres` directive (e.g. `gpu` or `gpu:h100`)."""
    exclusive: bool = True
    """Ask for whole nodes (`--exclusive`)."""
    segment: Optional[Annotated[int, Meta(ge=1, le=MAX_NODES)]] = None
    """`--segment` size for block/topology-aware placement (Slurm 23.11+): given to each allocation whose node count
    it divides; one larger than it that it does not divide is refused, a smaller one fits in one block."""
    constraint: Optional[Token] = None
    """`--constraint` feature expression."""
    container: Optional[Container] = None
    """Run every step in a pyxis container."""
    modules: Annotated[list[Text], Meta(max_length=MAX_ITEMS)] = []
    """Environment modules loaded before the roles start (`module load NAME`)."""
    venv: Optional[Text] = None
    """A Python virtual environment activated before the roles start."""
    setup: Annotated[list[ShellLine], Meta(max_length=MAX_ITEMS)] = []
    """Shell lines run before the roles start. Cluster-admin shell code, rendered verbatim:
    the one field that is shell by contract (topology values never are)."""
    python: NonEmptyText = "python3"
    """Interpreter that runs prl on compute nodes."""
    env: Env = {}
    """Variables exported to every role."""
    shared_root: PathText
    """Root of the shared filesystem every node sees (run directories belong under it)."""
    network: Network = Network()
    max_nodes: Annotated[int, Meta(ge=1, le=MAX_NODES)]
    """Most nodes one job may use."""
    default_time: Optional[SlurmTime] = None
    """Time limit when the topology gives none (a bare number is minutes)."""
    requeue: Requeue = Requeue()
    port_base: Annotated[int, Meta(ge=1024, le=65000)] = 8000
    """First port the roles' servers use on a node."""
    single_host: bool = False
    """Every node is the same host (several `slurmd -N` on one machine, a test cluster): servers get
    ports distinct job-wide, as in local runs, instead of the same ports on each node."""

    def __post_init__(self) -> None:
        checked_time(self, "default_time")
        if self.gpu_directive == "none" and not self.exclusive and self.gpu_node.gpus:
            # Without --exclusive a job gets the GPUs it asks for, and gpu_directive none asks for none.
            raise FieldValueError("gpu_directive", f"gpu_directive none asks Slurm for no GPUs, and on shared nodes "
                                                   f"(exclusive: false) a job gets only the GPUs it asks for: the "
                                                   f"{self.gpu_node.gpus} GPUs of gpu_node would reach no role; use "
                                                   f"gpus-per-node or gres, or exclusive: true")
        if any(c.isspace() for c in self.python):
            raise FieldValueError("python", f"python is one command, run as PYTHON -m prl...: {shown(self.python)} "
                                            f"holds a space, and the whole text would be looked up as one program; "
                                            f"set interpreter options in env: (PYTHONUNBUFFERED, ...) or setup:")
        # A bare python is looked up on PATH; a path, and every venv, must not depend on where a job starts.
        for name, relative in (("python", "/" in self.python), ("venv", self.venv is not None)):
            value = getattr(self, name)
            if relative and not value.startswith("/"):
                raise FieldValueError(name, f"{name} {shown(value)} is a relative path, which each job would read "
                                            f"from the directory it was submitted from: write it absolute")

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
