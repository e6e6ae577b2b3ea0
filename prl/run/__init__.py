"""The run directory and what processes say to each other: its layout, its typed records, the hand-offs.

    rundir.py       RunDir: the one object every role and command holds (create, reserve, reset; the rest below)
    layout.py       RunLayout: where everything of a run lies (paths only)
    files.py        atomic writes, fsyncs, markers: a reader never sees half a file
    records.py      the typed, versioned records of the run directory's JSON files
    handoffs.py     Handoffs: the records one process hands another (endpoints, ready, stop, pins, ...)
    publish.py      Publishing: the publish-a-step protocol, and waiting for one
    retention.py    Retention: which old steps go and which stay (pins, holds)
    lifecycle.py    a runtime role's start and end in its state file
    batch.py        the rollout batch the orchestrator hands the trainer for one step
    api.py          the bodies of prl's own HTTP routes, typed and size-bounded
    tenants.py      runs attached to an inference pool: who they are and what each may call

See docs/run-directory.md. Imports nothing heavy: login nodes and roles read the run alike.
"""
