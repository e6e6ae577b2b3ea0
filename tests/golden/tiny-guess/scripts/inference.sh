#!/bin/bash
# Rendered by prl: the 'inference' role of 'tiny-guess'. Do not edit: run `prl plan` again.
# Started by the launcher (a local process per task).
set -euo pipefail
umask 077  # the run's files are private to its owner (docs/run-directory.md)
export PRL_ROLE=inference
export PRL_RUN_DIR=/home/user/prl/runs/prl-runs/tiny-guess
export VLLM_CPU_KVCACHE_SPACE=2
exec python3 -m prl.job.role inference --run-dir /home/user/prl/runs/prl-runs/tiny-guess
