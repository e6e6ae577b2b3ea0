#!/bin/bash
# Rendered by prl: the 'orchestrator' role of 'lab'. Do not edit: run `prl plan` again.
# Started by the launcher (srun --het-group=1 --nodes=1 --ntasks-per-node=1 --cpus-per-task=8 --job-name=orchestrator --kill-on-bad-exit=1).
set -euo pipefail
umask 077  # the run's files are private to its owner (docs/run-directory.md)
export PRL_DEVICE=cpu
export PRL_ROLE=orchestrator
export PRL_RUN_DIR=/var/tmp/prl-runs/lab
exec python3 -m prl.job.role orchestrator --run-dir /var/tmp/prl-runs/lab
