"""The commands a user types on a login node (`prl status`, `prl logs`, ...), as prl/cli.py calls them.

    submit.py       `prl submit`: plan, render, submit one heterogeneous job (or local processes), record the handle
    status.py       `prl status`: one row per role, from Slurm and the run directory together
    logs.py         `prl logs`: the right log file from the run directory's layout, tailed or followed
    doctor.py       `prl doctor` without a run: what this machine has for each command, and the fix
    sweep.py        `prl eval ENV... --run RUN`: evaluate a run's weights steps, in-process or as a job array
    progress.py     what `prl submit --local` shows while the run goes on in the foreground
    registry.py     which runs this user submitted ($PRL_HOME/runs.jsonl)
    slurm.py        the one module that runs Slurm commands; everything else gets parsed rows
    metrics.py      a run's metrics.jsonl as per-step rows (`prl plot`, `prl wandb`)
    plot.py         `prl plot`: one PNG of a run's progress
    rollouts.py     `prl rollouts`: a run's sampled rollouts (or an eval's records), in the terminal or one HTML page
    export_data.py  `prl export-data`: the rollouts that scored well, as chat JSONL an `sft:` run trains on
    wandb_sync.py   `prl wandb`: a run's metrics as one W&B run

The control plane: no torch, vLLM, transformers or verifiers import (tests/test_imports.py).
"""
