"""Write the field reference of topologies and cluster profiles from the schema itself.

    python -m prl.config.schema_doc > docs/reference.md

tests/test_docs.py fails when docs/reference.md is out of date.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
import typing
from typing import Any

import msgspec

from prl.config.cluster import ClusterProfile
from prl.config.refusal import fields_of, struct_of
from prl.config.topology import Topology


def _type_name(annotation: Any) -> str:
    """A type as a reader says it: `int or None`, `list of str`, "one of `mask`, `clip`"."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(arg) for arg in args if arg not in (type(None), msgspec.UnsetType)]
        return " or ".join(names + (["None"] if type(None) in args else []))
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{value}`" for value in args)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return f"mapping of {_type_name(args[0])} to {_type_name(args[1])}"
    if annotation is typing.Any:
        return "any value"
    if annotation is type(None):
        return "None"
    return annotation.__name__ if isinstance(annotation, type) else str(annotation)


def _field_docs(model: type[msgspec.Struct]) -> dict[str, str]:
    """The docstring under each field, read from the source (Python keeps none at run time)."""
    docs: dict[str, str] = {}
    for cls in reversed([c for c in model.__mro__ if issubclass(c, msgspec.Struct) and c is not msgspec.Struct]):
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
        for field, doc in zip(body, body[1:]):
            if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                    and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                    and isinstance(doc.value.value, str)):
                docs[field.target.id] = inspect.cleandoc(doc.value.value)
    return docs


def _default(field: msgspec.structs.FieldInfo, sub: type | None) -> str:
    if field.required:
        return "required"
    default = field.default_factory() if field.default is msgspec.NODEFAULT else field.default
    if default is msgspec.UNSET:
        return "unset"
    return "see below" if sub and default is not None else repr(default)


def _rows(model: type[msgspec.Struct], prefix: str) -> list[str]:
    rows = []
    nested = []
    docs = _field_docs(model)
    for name, field in fields_of(model).items():
        path = f"{prefix}{name}"
        sub = struct_of(field.type)
        default = _default(field, sub)
        kind = sub.__name__ if sub else _type_name(field.type)
        described = docs.get(name)
        doc = (described or (sub.__doc__ or "").strip().splitlines()[0] if sub and sub.__doc__ else
               described or "").replace("\n", " ").replace("|", "\\|")
        doc = " ".join(doc.split())
        rows.append(f"| `{path}` | {kind.replace('|', ' or ')} | {default.replace('|', ' or ')} | {doc} |")
        if sub:
            nested.append((sub, path + "."))
    for sub, path in nested:
        rows += _rows(sub, path)
    return rows


RULES = """\
## What is refused in text, and why

- **Control and invisible characters**, in every text field: C0/C1 controls, line separators and Unicode's
  format characters (category Cf: zero-width spaces and joiners, bidirectional marks, overrides and isolates, tag
  characters), and the Hangul fillers (U+115F, U+1160, U+3164, U+FFA0: letters drawn as nothing). They make a
  value read other than it runs, on a terminal and in a script. A refused name says which character by its code
  point, since the quoted value would not show it.
- **Non-ASCII letters in names and ids** (`name`, `slurm.job_name`, partitions, account, qos, `environment.id`,
  W&B project and entity): a look-alike letter (Cyrillic `а` for Latin `a`) names another thing. Paths keep
  non-ASCII letters.
- **`~` and `$` in paths**: prl does not expand them, and a node would get `~/x` literally. Write an absolute
  path, or `${oc.env:HOME}/x` (resolved when planned; `HOME`, `USER`, `SCRATCH`, ... are readable anywhere).
- **A run directory under `/proc` or `/sys`** (written, or the profile's `shared_root` it defaults under): the
  kernel's view of one machine, where no run's files can be written and no other node looks. A `..` component
  in `run_dir` is refused too: the directory must read as the place it is.
- **A profile's `python` with a space** (`python3 -u`): it is run as one command, `PYTHON -m prl...`; set
  interpreter options through `env:` or `setup:`. **A relative `venv`, or a relative path as `python`**: a job
  would read it from the directory it was submitted from (a bare name such as `python3` is looked up on PATH).
- **`%` in the run directory** (the topology's `run_dir`, or the profile's `shared_root` it defaults under):
  Slurm reads `%j`, `%x`, ... in the job's `--output` path as patterns. Escaping it as `%%` there would be
  right for Slurm and wrong everywhere else the path goes (scripts, environment, container mounts), so it is
  refused rather than given two spellings.
- **`,` and `:` in the run directory on a profile with a container**, and in a `container.mounts` item beyond
  `SRC:DST[:FLAGS]`: pyxis splits `--container-mounts` at `,` (another mount) and `:` (source, target, flags).
- **Variables prl or Slurm sets in `env:` maps**: `SLURM_*`, `CUDA_VISIBLE_DEVICES`, `VLLM_NIXL_SIDE_CHANNEL_*`
  and prl's own `PRL_RUN_DIR`, `PRL_ROLE`, `PRL_ATTEMPT`, `PRL_ATTEMPT_BASE`, `PRL_MODE`, `PRL_RESTART`,
  `PRL_TASK`, `PRL_TASKS`, `PRL_NODE`, `PRL_INFERENCE_API_KEY`: one of the two values would silently lose.
  prl's knobs (`PRL_DEVICE`, `PRL_LOG_LEVEL`, ...) may be set.
- **A leading `-` in paths and ids** (`model.path`, `environment.id`, `wandb.project`, ...): the command they are
  passed to would read `--trust-remote-code` or `--help` as an option. Write `./-x` for such a relative path.

## What contradicts, and is refused rather than ignored

- **YAML 1.1 octal numbers**: a plain `0100` reads as 64. Write `100`, or `'0100'` for the text.
- **`extra_args` naming an option the plan sets** (`--model`, `--served-model-name`, `--tensor-parallel-size`,
  `--port`, the data-parallel and KV options, ...) and **`extra_directives` naming an option the plan renders**
  (`--mem`, `--gres`, `--account`, ... when it renders them) or one that changes the job's layout, logs or
  environment (`--output`, `--error`, `--array`, `--nodes`, `--ntasks*`, `--cpus-per-task`, `--partition`,
  `--time`, `--job-name`, `--chdir`, `--export`, ...): one of the two would silently win. Set the field instead.
- **Disaggregated-only fields beside unified inference** (`inference.router`, `inference.kv_connector`) and
  unified-only fields beside prefill + decode.
- **`kv_offload.disk_gb` without `disk_path`**: the disk tier would be dropped.
- **A shared orchestrator's `cpus` over a node's**, as an own node's; on a CPU profile (`gpu_node.gpus: 0`),
  **trainer ranks per node (`gpus_per_node`) or an inference server's tp * dp workers over the node's `cpus`**.
- **A profile's `segment` that does not divide an allocation larger than it**: Slurm refuses the job. An
  allocation smaller than a segment fits in one block and is asked for without `--segment`.
- **`overlong_penalty` without `overlong_buffer`** (the punishment is off without its buffer), and an
  `overlong_buffer` of `max_tokens` or more.
- **`training.router_aux_loss_coef` on a dense model** (its config.json counts no experts): there is no router
  to balance. A model whose config.json is not on this machine is not checked.
- **`on_failure.policy: fail` beside a `max_restarts` above 0**, written: the policy would win and the restarts
  never happen. Use `policy: restart`, or leave `max_restarts` out (under `fail` no restart is made).
- **A time limit of zero** (`slurm.time`, the profile's `default_time`): Slurm reads it as no limit at all, which
  a partition with a `MaxTime` keeps pending for good. prl cannot see a partition's own limit; Slurm checks it
  at `prl submit`. Negative and malformed times do not read as a Slurm time.
- **`gpu_directive: none` on shared nodes** (`exclusive: false`) of a profile with GPUs: a job on a shared node
  gets only the GPUs it asks for, and `none` asks for none.
- **A model config.json with no attention heads** (`num_attention_heads` or `num_key_value_heads` below 1), or
  with query heads that are no multiple of its key/value heads: no attention can be built from it.
- **Two planned ports equal on one node** (servers, data-parallel RPC, NIXL side channels, the router, the
  trainer's rendezvous and weight ports): refused at the port the user chose. A router port chosen inside the
  NIXL side channels' range is not refused: the side channels start just past it.

## Environment references

An `env:` value may read the node's environment: `${oc.env:NAME}` (refused when unset at plan time),
`${oc.env:NAME,default}` with a default of ASCII letters, digits and `./:@+-`, or `${oc.env:NAME,'any text'}`
for other letters or spaces (OmegaConf reads only those unquoted). A quoted default holds no quote, `$`,
backtick, backslash or brace: the shell would read them inside the expansion. Other fields may read only
`USER`, `LOGNAME`, `HOME`, `PWD`, `TMPDIR`, `SCRATCH` and `WORK` (resolved at plan time), in topologies and
cluster profiles alike.

## Size bounds

A plan holds at most 100000 inference servers (srun tasks) and 262144 GPUs, and a command line at most 1000
overrides: every count may be legal while their product is millions of records. The bounds hold under
`prl plan --no-write` too: they bound the job and the records the planner builds, not the files it writes.
"""


def reference() -> str:
    head = "| field | type | default | meaning |\n|---|---|---|---|"
    return "\n".join([
        "# Field reference",
        "",
        "Generated from the schema by `python -m prl.config.schema_doc > docs/reference.md`; do not edit by hand.",
        "",
        "## Topology (`configs/*.yaml`)",
        "",
        head,
        *_rows(Topology, ""),
        "",
        "## Cluster profile (`clusters/*.yaml`)",
        "",
        head,
        *_rows(ClusterProfile, ""),
        "",
        RULES,
    ]).rstrip("\n") + "\n"


if __name__ == "__main__":
    import sys

    from prl.errors import run_entry

    sys.exit(run_entry("prl schema_doc", lambda: print(reference(), end="")))
