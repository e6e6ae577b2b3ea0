"""The user's files, checked: topologies and cluster profiles, their schemas and how a refusal reads.

    topology.py     the topology schema (`configs/*.yaml`): what the user asks for, checked, nothing derived
    cluster.py      cluster profiles (`clusters/*.yaml`): what a cluster offers and how it wants to be asked
    types.py        the schemas' base types and bounds (Strict, Text, PathText, Token, Name, SlurmTime, MAX_*)
    loader.py       YAML -> validated model, errors naming the file, the line and the field
    fields.py       a field's path, a schema's blame of one field, a value as shown in a message
    refusal.py      why msgspec refused a document, as one message at one field (imported only on a refusal)
    external.py     files prl did not write (config.json, tokenizer.json, another run's plan.json): bounded, typed reads
    schema_doc.py   docs/reference.md's field reference, written from the schemas themselves

Imports nothing heavy: `prl plan` on a login node loads this package first.
"""
