"""The `prl` in-process harness under the id verifiers imports it by: `prl_harness`.

verifiers resolves a harness id by importing a top-level module that exports one `Harness`
subclass in `__all__`. The harness lives in prl/orchestrator/harness.py; this package makes its
id importable in any process, including the env worker processes of `orchestrator.env_workers`
(spawned: they see no `sys.modules` alias made in the orchestrator).
"""

from prl.orchestrator.harness import PrlHarness, PrlHarnessConfig

__all__ = ["PrlHarness", "PrlHarnessConfig"]
