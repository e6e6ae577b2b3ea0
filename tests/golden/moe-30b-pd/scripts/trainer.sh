#!/bin/bash
# Rendered by prl: the 'trainer' role of 'moe-30b-pd'. Do not edit: run `prl plan` again.
# Started by the launcher (srun --het-group=3 --nodes=4 --ntasks-per-node=1 --cpus-per-task=112 --job-name=trainer --kill-on-bad-exit=1 --gres=gpu:8 --container-image=nvcr.io#nvidia/pytorch:25.09-py3 --container-mounts=/lustre/fs1:/lustre/fs1,/lustre/fs1/prl/runs/moe-30b-pd:/lustre/fs1/prl/runs/moe-30b-pd --container-workdir=/lustre/fs1/prl).
set -euo pipefail
umask 077  # the run's files are private to its owner (docs/run-directory.md)
export GLOO_SOCKET_IFNAME=ib0
export HF_HUB_OFFLINE=1
export NCCL_IB_HCA=mlx5_0,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_9,mlx5_10,mlx5_11
export NCCL_IB_QPS_PER_CONNECTION=2
export NCCL_SOCKET_IFNAME=ib0
export PRL_ROLE=trainer
export PRL_RUN_DIR=/lustre/fs1/prl/runs/moe-30b-pd
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export UCX_NET_DEVICES=mlx5_0:1
exec python3 -m prl.job.role trainer --run-dir /lustre/fs1/prl/runs/moe-30b-pd
