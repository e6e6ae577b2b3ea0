#!/bin/bash
# Rendered by prl: the 'orchestrator' role of 'mixtral-8x7b'. Do not edit: run `prl plan` again.
# Started by the launcher (srun --het-group=1 --nodes=1 --ntasks-per-node=1 --cpus-per-task=64 --job-name=orchestrator --kill-on-bad-exit=1 --container-image=nvcr.io#nvidia/pytorch:25.09-py3 --container-mounts=/lustre/fs1:/lustre/fs1,/lustre/fs1/prl/runs/mixtral-8x7b:/lustre/fs1/prl/runs/mixtral-8x7b --container-workdir=/lustre/fs1/prl).
set -euo pipefail
umask 077  # the run's files are private to its owner (docs/run-directory.md)
export GLOO_SOCKET_IFNAME=ib0
export HF_HUB_OFFLINE=1
export NCCL_IB_HCA=mlx5_0,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_9,mlx5_10,mlx5_11
export NCCL_IB_QPS_PER_CONNECTION=2
export NCCL_SOCKET_IFNAME=ib0
export PRL_ROLE=orchestrator
export PRL_RUN_DIR=/lustre/fs1/prl/runs/mixtral-8x7b
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export UCX_NET_DEVICES=mlx5_0:1
exec python3 -m prl.job.role orchestrator --run-dir /lustre/fs1/prl/runs/mixtral-8x7b
