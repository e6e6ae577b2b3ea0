#!/bin/bash
# Rendered by prl: the 'trainer' role of 'sft-lab'. Do not edit: run `prl plan` again.
# Started by the launcher (srun --relative=0 --nodes=2 --ntasks-per-node=1 --cpus-per-task=8 --job-name=trainer --kill-on-bad-exit=1 --gpus-per-node=1).
set -euo pipefail
umask 077  # the run's files are private to its owner (docs/run-directory.md)
export PRL_DEVICE=cpu
export PRL_ROLE=trainer
export PRL_RUN_DIR=/var/tmp/prl-runs/sft-lab
exec python3 -m prl.job.role trainer --run-dir /var/tmp/prl-runs/sft-lab
