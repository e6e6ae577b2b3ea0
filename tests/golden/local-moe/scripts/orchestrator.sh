#!/bin/bash
# Rendered by prl: the 'orchestrator' role of 'local-moe'. Do not edit: run `prl plan` again.
# Started by the launcher (a local process per task).
set -euo pipefail
umask 077  # the run's files are private to its owner (docs/run-directory.md)
export PRL_ROLE=orchestrator
export PRL_RUN_DIR=/home/user/prl/runs/prl-runs/local-moe
exec python3 -m prl.job.role orchestrator --run-dir /home/user/prl/runs/prl-runs/local-moe
