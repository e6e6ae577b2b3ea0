"""A job's processes on the nodes: the launcher, each role's task, its checks and its runtime.

    launch.py       the launcher (`python -m prl.job.launch`): starts the roles in order, watches them, ends the job
    role.py         one task of one role, started by a launch script: preflight first, then the role's work
    preflight.py    what every role checks on its node before anything else (`prl doctor RUN`)
    runtimes.py     how one task of each role starts its runtime process and proves it healthy

The launcher imports no torch, vLLM or verifiers; a role's task imports its runtime when it starts it.
"""
