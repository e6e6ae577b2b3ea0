"""Files -> Plan -> rendered files: the I/O around the pure planner, shared by `plan` and `submit`."""

from __future__ import annotations

import json
import math
import stat
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Sequence

import msgspec
import yaml

from prl.config.external import Unreadable, read_json, real_path, stat_of
from prl.planner.capabilities import ModelConfig
from prl.config.cluster import CLUSTERS_DIR, ClusterProfile, load_profile, profile_path
from prl.errors import ConfigError
from prl.config.loader import Source, load_document, validate
from prl.planner.plan import Plan, make_plan
from prl.planner.tokenizers import tokenizer_difference
from prl.config.topology import Topology, cluster_overrides
from prl.states import Role
from prl.weights.layout import ADAPTER_CONFIG


@dataclass(frozen=True)
class Prepared:
    topology: Topology
    cluster: ClusterProfile
    plan: Plan
    topology_yaml: str
    """The topology as prl read it, for RUN/topology.yaml: overrides and interpolation applied, but
    `${oc.env:...}` left as written (a value read from the environment is never written to disk)."""
    shares: tuple = ()
    """What each worker of each weight-loading role receives per update (`weight_shares`; () when unknown)."""
    why_not: str = ""
    """Why `shares` is empty (the model's files are not on this machine, ...)."""

    @cached_property
    def files(self) -> dict[str, str]:
        """Relative path in the run directory -> text (rendered on first use: `--no-write` needs none)."""
        from prl.planner.render import render

        return render(self.plan, self.topology_yaml)

    @property
    def run_dir(self) -> Path:
        return Path(self.plan.run_dir)


RL_TRAINING = ("rollouts_per_example", "max_off_policy_steps", "max_tokens", "temperature", "loss", "advantage",
               "max_concurrent_rollouts", "rollout_mode", "rollout_retries", "weight_update_retries",
               "weights_timeout_s", "endpoint_timeout_s", "rollout_timeout_s")
"""`training:` fields only an RL run reads (refused in an SFT topology, which would silently ignore them)."""


def _absolute(path: str, cwd: Path) -> str:
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else (cwd / p))


def _absolute_model_paths(topo: Topology, cwd: Path) -> Topology:
    """A model (or SFT data) path that exists relative to where prl runs becomes absolute: the roles run elsewhere.
    Anything else (a hub id, a path only the compute nodes see) is left as written."""

    def found(value: str | None) -> str | None:
        if value and not Path(value).is_absolute() and (cwd / value).exists():
            return str((cwd / value).resolve())
        return None

    update = {key: new for key in ("path", "tokenizer") if (new := found(getattr(topo.model, key)))}
    if update:
        topo = msgspec.structs.replace(topo, model=msgspec.structs.replace(topo.model, **update))
    scorers = {role: msgspec.structs.replace(group, **new) for role, group in topo.scorers().items()
               if (new := {key: p for key in ("path", "tokenizer") if (p := found(getattr(group, key)))})}
    if scorers:
        topo = msgspec.structs.replace(topo, **scorers)
    if topo.sft is not None and (data := found(topo.sft.data)):
        topo = msgspec.structs.replace(topo, sft=msgspec.structs.replace(topo.sft, data=data))
    return topo


def _weights_of_run(topo: Topology, source: Source, cwd: Path) -> Topology:
    """`model.from_run` (+ `from_step`) -> `model.path` = that run's published weights step (checked STABLE)."""
    from prl.run.rundir import RunDir

    m = topo.model
    if m.from_run is None:
        return topo
    run = RunDir(_absolute(m.from_run, cwd))
    try:
        if stat_of(run.plan_json) is None:
            raise source.error(("model", "from_run"), f"{run.root} is not a prl run directory (no plan.json)")
        published = run.stable_steps("weights")
    except Unreadable as exc:
        raise source.error(("model", "from_run"), str(exc)) from None
    except OSError as exc:  # its weights/ listed, or a step's marker read
        raise source.error(("model", "from_run"), f"cannot read {run.root}'s weights: {exc.strerror}") from None
    if not published:
        raise source.error(("model", "from_run"), f"{run.root} has published no weights yet (weights/step_N with "
                                                  f"its STABLE marker); is its job still running?")
    step = published[-1] if m.from_step is None else m.from_step
    if step not in published:
        shown_steps = ", ".join(map(str, published[-10:]))
        raise source.error(("model", "from_step"), f"{run.root} has no published weights step {step} "
                                                   f"(published: {shown_steps})")
    if (run.weights(step) / ADAPTER_CONFIG).is_file():
        raise source.error(("model", "from_run"), f"{run.weights(step)} is a LoRA adapter (model.lora), not a model: "
                                                  f"merge it first, `prl export {run.root} --step {step} --merged -o "
                                                  f"DIR`, and use model.path: DIR")
    # The plan names the weights directory itself (RUN/topology.yaml keeps `from_run` as written).
    return msgspec.structs.replace(topo, model=msgspec.structs.replace(m, path=str(run.weights(step)),
                                                                       from_run=None, from_step=None))


def _attached_pool(topo: Topology, source: Source, cwd: Path) -> Topology:
    """`inference.attach` -> the pool's absolute run directory, checked: a running pool's plan (an inference pool),
    serving this run's model, with room for its adapter's rank and a name other than the pool's own."""
    from prl.planner.model import Plan
    from prl.run.rundir import RunDir

    if not topo.attached:
        return topo
    field = (Role.INFERENCE, "attach")
    try:
        pool = RunDir(str(real_path(_absolute(topo.inference.attach, cwd))))
        plan = read_json(pool.plan_json, Plan, MAX_PLAN_BYTES, "a prl plan.json")
    except Unreadable as exc:
        raise source.error(field, str(exc)) from None
    if plan is None:
        raise source.error(field, f"{pool.root} is not a prl run directory (no plan.json): plan and submit the pool "
                                  f"first (a topology with pool:)")
    if plan.pool is None:
        raise source.error(field, f"{pool.root} is the run directory of {plan.name!r}, which is not an inference pool "
                                  f"(its topology has no pool: section)")
    if plan.name == topo.name:
        raise source.error(("name",), f"the run is named {topo.name!r} like the pool it attaches to, whose model is "
                                      f"served under that name; name the run otherwise")
    try:
        other_model = real_path(plan.pool.model) != real_path(topo.model.path)
    except Unreadable as exc:
        raise source.error(field, f"the pool's model: {exc}") from None
    if other_model:
        raise source.error(("model", "path"), f"the pool {pool.root} serves {plan.pool.model}, and this run trains an "
                                              f"adapter on {topo.model.path}: an adapter is served on its own base model")
    if topo.model.lora.rank > plan.pool.max_lora_rank:
        raise source.error(("model", "lora", "rank"), f"rank {topo.model.lora.rank} is over the pool's max_lora_rank "
                                                      f"({plan.pool.max_lora_rank}, {pool.root})")
    return msgspec.structs.replace(topo, inference=msgspec.structs.replace(topo.inference, attach=str(pool.root)))


def check_scorer_tokenizers(topo: Topology, source: Source) -> None:
    """A teacher or reference scores the student's token ids: its tokenizer must be the student's (compared from
    the files, prl/planner/tokenizers.py, when this machine sees both directories)."""
    student = topo.model.tokenizer or topo.model.path
    for role, scorer in topo.scorers().items():
        if scorer.path is None and scorer.tokenizer is None:
            continue  # a reference of the student's own model
        own = scorer.tokenizer or scorer.path
        field = "tokenizer" if scorer.tokenizer else "path"
        try:
            found = stat_of(Path(own).expanduser())
            if found is not None and not stat.S_ISDIR(found.st_mode):
                raise source.error((role, field), f"{own} is a file; the {role}'s {field} is a model directory "
                                                  f"(its config.json, weights and tokenizer files)")
            why = tokenizer_difference(student, own)
        except Unreadable as exc:
            raise source.error((role, field), f"comparing the {role}'s tokenizer with the student's: {exc}") from None
        if why:
            raise source.error((role, field), f"{role} tokenizer ({own}) is not the student's ({student}): {why}; "
                                              f"the {role} scores the student's token ids, so both must tokenize alike")


MAX_MODEL_CONFIG_BYTES = 4 << 20
"""Largest model config.json read (real ones are a few KiB; a 1T-class MoE's is under 10 KiB)."""


def model_config(topo: Topology, source: Source) -> ModelConfig | None:
    """The model's config.json when this machine sees the model directory (None: a hub id or a remote path),
    read with a size bound and checked as the planner reads it: a huge, deeply nested or mistyped file is a
    one-line error at `model.path`, never a traceback."""
    path = Path(topo.model.path) / "config.json"
    try:
        return read_json(path, ModelConfig, MAX_MODEL_CONFIG_BYTES, "a model config.json")
    except Unreadable as exc:
        raise source.error(("model", "path"), str(exc)) from None


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
"""Bytes per element of what the trainer publishes in each `model.dtype` (`auto`: the checkpoint's own)."""


@dataclass(frozen=True)
class WeightShare:
    """What each worker of one inference role's servers receives per update: its slices (prl/weights/slices.py)."""

    role: str
    tp: int
    dp: int
    expert_parallel: bool
    most: int
    """Bytes of the largest worker's share."""
    least: int
    whole: int
    """Bytes of the whole step."""
    layer_most: int = 0
    """Bytes of the largest worker's share of the largest decoder layer: what it holds received at once at most
    (vLLM's layerwise reload keeps a layer's tensors until the layer is whole)."""


def weight_shares(plan: Plan) -> tuple[tuple[WeightShare, ...], str]:
    """Bytes per worker per update for each role that loads the policy's weights, from the model's config.json and
    its safetensors headers (read here, no tensor touched); () and why not when this machine cannot say."""
    from prl.states import WEIGHT_ROLES
    from prl.weights.layout import UpdateRefused, checkpoint_layout
    from prl.weights.slices import largest_layer_bytes, server_places, slice_plan, wire_layout, worker_bytes

    model = plan.settings().model
    roles = [r for r in plan.inference if r.name in WEIGHT_ROLES]
    if plan.trainer is None or not roles:
        return (), ""
    if model.lora is not None:
        return (), "each update is the LoRA adapter alone"
    path = Path(model.path)
    try:
        if (path / "config.json").stat().st_size > MAX_MODEL_CONFIG_BYTES:
            return (), f"{path / 'config.json'} is too large to be a model's config.json"
        config = json.loads((path / "config.json").read_text())
        layout = checkpoint_layout(path)
    except (OSError, ValueError, RecursionError, UpdateRefused):
        return (), f"the model's files are not readable on this machine ({model.path})"
    size = DTYPE_BYTES.get(model.dtype)
    if size is None:
        return (), f"model.dtype {model.dtype}: the bytes depend on the checkpoint's own dtypes"
    try:
        shapes, sizes = wire_layout(config, layout, size)  # block FP8: the quantised weights' bytes and scales
    except ValueError as exc:
        return (), f"{path / 'config.json'}: {exc}"
    whole = worker_bytes(dict.fromkeys(shapes), shapes, sizes)
    shares = []
    for role in roles:
        try:
            # The rules give the first worker the most (every even chunk, full vocabulary rows, the extra experts
            # of an uneven EP split) and the last the least: two plans, not one per worker (48 at moe-1t), keep
            # `prl plan` quick on a login node that sees a 1T checkpoint.
            places = server_places(role.tp, role.dp, role.expert_parallel)
            first = slice_plan(config, shapes, places[0])  # by the rules, the first worker gets the most
            got = [worker_bytes(p, shapes, sizes) for p in (first, slice_plan(config, shapes, places[-1]))]
        except (ValueError, KeyError, TypeError) as exc:
            return (), f"{role.name}: its slices cannot be computed ({exc})"
        shares.append(WeightShare(role.name, role.tp, role.dp, role.expert_parallel, max(got), min(got), whole,
                                  largest_layer_bytes(first, shapes, sizes)))
    return tuple(shares), ""


VLLM_GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default share of each GPU's memory (`--gpu-memory-utilization`) for weights, activations and KV."""


def check_receive_buffers(prepared: Prepared, source: Source, shares: Sequence[WeightShare]) -> None:
    """Under `weights.backend: nccl` each worker receives a step into GPU memory beside vLLM's share of it: the
    largest layer's slices at once, once for the received tensors and once for the layer vLLM rebuilds from
    them. Refused at the role's gpu_memory_utilization where that does not fit (profiles that say
    `gpu_node.gpu_memory_gb`)."""
    plan, gpu_gb = prepared.plan, prepared.cluster.gpu_node.gpu_memory_gb
    if plan.trainer is None or plan.trainer.weight_backend != "nccl" or gpu_gb is None:
        return
    groups = prepared.topology.inference.groups()
    for share in shares:
        group = groups.get(share.role)
        if group is None:
            continue
        share_of_gpu = group.gpu_memory_utilization or VLLM_GPU_MEMORY_UTILIZATION
        free = (1 - share_of_gpu) * gpu_gb * 2**30
        if 2 * share.layer_most > free:
            most = max(0.0, 1 - 2 * share.layer_most / (gpu_gb * 2**30))
            field = (Role.INFERENCE, "gpu_memory_utilization") if share.role == Role.INFERENCE else \
                (Role.INFERENCE, share.role, "gpu_memory_utilization")
            raise source.error(field, (
                f"under weights.backend: nccl each {share.role} worker receives up to {share.layer_most / 2**30:.2f} "
                f"GiB of one layer into GPU memory, twice over while vLLM rebuilds it ({2 * share.layer_most / 2**30:.2f} "
                f"GiB), beside vLLM's {share_of_gpu:g} of the {gpu_gb:g} GiB GPU ({free / 2**30:.2f} GiB left): set "
                f"gpu_memory_utilization <= {math.floor(most * 100) / 100:.2f}, or weights.backend: gloo"))


def prepare(topology_path: Path, overrides: Sequence[str] = (), cwd: Path | None = None) -> Prepared:
    """Load and check everything, plan, render in memory. Writes nothing."""
    cwd = cwd or Path.cwd()
    own = [item for item in overrides if not item.startswith("cluster.")]
    data, source = load_document(topology_path, own)
    topo = validate(Topology, data, source)
    if topo.sft is not None:
        stray = [key for key in RL_TRAINING if key in (data.get("training") or {})]
        if stray:
            raise source.error(("training", stray[0]), f"{stray[0]} is an RL setting (rollouts, the policy loss, the "
                                                       f"weight sync); an SFT run would ignore it: remove it")
    topo = _attached_pool(_weights_of_run(_absolute_model_paths(topo, cwd), source, cwd), source, cwd)
    check_scorer_tokenizers(topo, source)
    if not profile_path(topo.cluster, topology_path.parent).exists():
        known = ", ".join(sorted(p.stem for p in CLUSTERS_DIR.glob("*.yaml")))
        raise source.error(("cluster",), f"no cluster profile {topo.cluster!r} ({profile_path(topo.cluster, topology_path.parent)}); "
                                         f"shipped profiles: {known}")
    cluster, cluster_source = load_profile(topo.cluster, topology_path.parent, cluster_overrides(overrides))
    shared_root = _absolute(cluster.shared_root, cwd)
    cluster = msgspec.structs.replace(cluster, shared_root=shared_root)
    run_dir = _absolute(topo.run_dir or f"{shared_root.rstrip('/')}/prl-runs/{topo.name}", cwd)
    run_dir = str(Path(run_dir))  # normalise '//' and a trailing '/'
    plan = make_plan(topo, source, cluster, cluster_source, run_dir, model_config(topo, source))
    header = f"# {topology_path.name} as resolved by prl (overrides applied; ${{oc.env:...}} kept as written)\n"
    shares, why_not = weight_shares(plan)
    prepared = Prepared(topo, cluster, plan, header + yaml.safe_dump(source.written, sort_keys=False), shares, why_not)
    check_receive_buffers(prepared, source, shares)
    return prepared


class _NamedPlan(msgspec.Struct):
    """The one field of another run's plan.json that says whose run directory it is."""

    name: str = ""


MAX_PLAN_BYTES = 64 << 20
"""Largest plan.json read back (the 1T-class topology's is well under 1 MiB)."""


def _plan_name(plan_json: Path) -> str | None:
    """The run name in an existing plan.json; None when there is none or it is not a plan."""
    try:
        if not plan_json.is_file() or plan_json.stat().st_size > MAX_PLAN_BYTES:
            return None
        return msgspec.json.decode(plan_json.read_bytes(), type=_NamedPlan).name
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def check_run_dir_is_ours(root: Path, name: str) -> None:
    """Refuse a `run_dir` that exists and is neither empty nor a prl run of `name`: the planner makes it
    0700 and replaces plan.json, topology.yaml and scripts/ in it (a home directory, a checkout...)."""
    if not root.exists() and not root.is_symlink():
        return
    if not root.is_dir():
        raise ConfigError(f"run_dir {root} exists and is not a directory; choose another run_dir")
    try:
        entries = sorted(p.name for p in root.iterdir())
    except OSError as exc:
        raise ConfigError(f"cannot read the run_dir {root}: {exc.strerror}") from None
    theirs = _plan_name(root / "plan.json")
    if not entries or theirs == name:
        return
    what = f"a prl run of {theirs!r}" if theirs else f"holds {', '.join(entries[:3])}{', ...' if len(entries) > 3 else ''}"
    raise ConfigError(f"run_dir {root} is neither empty nor a prl run of {name!r} ({what}); prl would make it "
                      f"private and replace files in it: choose a new or empty run_dir")


def write_run_files(prepared: Prepared, *, force: bool = False) -> list[Path]:
    """Write the rendered files into the run directory; refuse one that holds a submitted job."""
    from prl.run.rundir import RunDir

    run = RunDir(prepared.run_dir)
    check_run_dir_is_ours(run.root, prepared.plan.name)
    if run.job_json.exists() and not force:
        raise ConfigError(f"{run.root} holds a submitted job ({run.job_json}); writing new scripts there would "
                          f"change a running job's files: use another run_dir or --force")
    from prl.planner.render import write

    try:
        return write(prepared.files, run.root)
    except OSError as exc:
        raise ConfigError(f"cannot write the run directory {run.root}: {exc.strerror} ({exc.filename})") from None
