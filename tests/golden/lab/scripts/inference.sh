#!/bin/bash
# Rendered by prl: the 'inference' role of 'lab'. Do not edit: run `prl plan` again.
# Started by the launcher (srun --het-group=0 --nodes=1 --ntasks-per-node=2 --cpus-per-task=4 --job-name=inference --kill-on-bad-exit=1 --gpus-per-node=2).
set -euo pipefail
umask 077  # the run's files are private to its owner (docs/run-directory.md)
export PRL_DEVICE=cpu
export PRL_ROLE=inference
export PRL_RUN_DIR=/var/tmp/prl-runs/lab
export VLLM_CPU_KVCACHE_SPACE=1
exec python3 -m prl.job.role inference --run-dir /var/tmp/prl-runs/lab
