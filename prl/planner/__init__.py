"""Topology + cluster profile -> a frozen Plan -> the rendered job. Pure but for prepare.py and render.py.

    plan.py          `make_plan`: who runs where, every number derived and checked
    model.py         the Plan: frozen, typed; what every role reads from plan.json
    settings.py      the user's own settings every role needs, carried by the Plan
    capabilities.py  what the trainer can execute, checked against the model's config.json
    tokenizers.py    do two model directories tokenize alike (from the files alone)
    prepare.py       files -> Plan -> rendered files: the I/O around the planner (`plan`, `submit`)
    render.py        Plan -> the sbatch script, one launch script per role, plan.json
    show.py          the tables `prl plan` prints

See docs/planner.md. Imports nothing heavy.
"""
