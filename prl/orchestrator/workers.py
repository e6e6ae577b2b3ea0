"""Environment rollouts in worker processes: verifiers' env server pool behind the orchestrator's Generator.

    orchestrator (one process)                     env workers (orchestrator.env_workers processes)
      TaskStream -> Generator.rollout ----run------> EnvServer: harness, interception, train client,
        routing, retries, version stamps  <-trace--    rendering, scoring (verifiers' code)
      advantages, packing, publishing

One rollout costs the orchestrator's process about 5-7 ms of CPU with prl's fast path
(`bench/bench_rollout_cpu.py`), and prl's own code is a small part of it: the rest is verifiers' and renderers'.
So the way past one core is to run episodes elsewhere. `EnvWorkers` does that with
verifiers' own serving stack (`verifiers.v1.serve`). `serve_env` runs in a spawned process: a
ZMQ broker over N pre-spawned `EnvServer` processes (one `EnvServer` when N is 1). Each
`run_slot` becomes an `EnvClient.run`: it sends the task's data and the server's client
config, and the traces stream back as a `WireEpisode` that `rollout_from_episode` reads as
usual. The Generator is unchanged: it still picks the server, stamps the version and retries.

Workers import the environment by its taskset id and the harness by its own (`prl_harness`, a
top-level package). A dotted environment id works only in-process (it is an alias made in
this process's `sys.modules`), so worker mode refuses one.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import queue
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from prl.errors import ConfigError, StartError, StartTimeout
from prl.log import get_logger

log = get_logger(__name__)

POOL_START_TIMEOUT_S = 300.0
"""How long the pool may take to bind and answer a health check (each worker imports verifiers and
transformers and loads the environment)."""


def check_env_id(env_id: str) -> None:
    """Worker mode needs an environment the workers can import by name."""
    if "." in env_id:
        raise ConfigError(
            f"environment.id {env_id!r}: orchestrator.env_workers needs an installed environment package "
            f"imported by its top-level name (e.g. {env_id.rsplit('.', 1)[-1]!r}); a module path only "
            f"works with env_workers: 0")


class EnvWorkers:
    """An env's rollouts served by `workers` processes; used by `Generator` in place of the env itself
    (`taskset` for the task stream, `serving()` around the run, `run_slot(slot, ctx)` per episode)."""

    def __init__(self, env: Any, workers: int):
        self.env = env
        self.taskset = env.taskset
        self.workers = workers
        self.client: Any = None

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[EnvWorkers]:
        from verifiers.v1.serve.client import EnvClient
        from verifiers.v1.serve.pool import env_config_data, serve_env

        spawn = multiprocessing.get_context("spawn")  # a fork would copy this process's event loop and threads
        with tempfile.TemporaryDirectory(prefix="prl-env-") as tmp:
            addresses = spawn.Queue()
            # The workers end with this process: the pipe's only writer is here, so the pool reads EOF when
            # this process dies, even by SIGKILL, and stops. (Without a log_setup, workers log warnings and
            # errors to stderr, the orchestrator's log, and drop verifiers' per-rollout info lines.)
            reader, writer = spawn.Pipe(duplex=False)
            server = spawn.Process(
                target=serve_env, name="prl-env-workers", daemon=False,
                kwargs=dict(max_workers=self.workers, elastic=False, address=f"ipc://{Path(tmp) / 'env.sock'}",
                            address_queue=addresses, death_pipe=reader,
                            config_data=env_config_data(self.env.config)),
            )
            server.start()
            try:
                address = await asyncio.to_thread(self._address, addresses, server)
                self.client = EnvClient(address)
                await self.client.wait_for_server_startup(timeout=POOL_START_TIMEOUT_S)
                log.info("environment runs in %d worker process(es) at %s", self.workers, address)
                yield self
            finally:
                if self.client is not None:
                    await self.client.close()
                    self.client = None
                server.terminate()  # SIGTERM: the broker stops its workers
                await asyncio.to_thread(server.join, 30)
                if server.is_alive():
                    server.kill()
                    await asyncio.to_thread(server.join, 10)
                writer.close()

    @staticmethod
    def _address(addresses: Any, server: Any) -> str:
        """The address the pool bound, or the reason it did not start."""
        waited = 0.0
        while waited < POOL_START_TIMEOUT_S:
            try:
                return addresses.get(timeout=1.0)
            except queue.Empty:
                waited += 1.0
                if not server.is_alive():
                    raise StartError(f"the environment worker pool exited with code {server.exitcode} before "
                                     f"it served (its log is the orchestrator's)") from None
        raise StartTimeout(f"the environment worker pool did not start within {POOL_START_TIMEOUT_S:.0f} s")

    async def run_slot(self, slot: Any, ctx: Any) -> Any:
        """One episode on a worker, with the server and sampling of `ctx` (a verifiers ModelContext)."""
        assert self.client is not None, "run_slot outside serving()"
        data = slot.task.data.model_dump(mode="json")
        return await self.client.run(client=ctx.client, model=ctx.model, sampling=ctx.sampling, task_data=data)
