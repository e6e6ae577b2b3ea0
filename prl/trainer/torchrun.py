"""`python -m prl.trainer.torchrun TORCHRUN-ARGS`: torchrun, its rendezvous store listening on the node's address only.

torchrun's static rendezvous (`--master-addr/--master-port`) starts the job's TCPStore on node 0 with a
port alone, and a TCPStore given a port alone listens on every interface of the node ("::" or 0.0.0.0),
where anyone who reaches the node can read and write the ranks' rendezvous keys. This entry registers
the rendezvous backend RENDEZVOUS_BACKEND (prl/planner/model.py), torch's static rendezvous whose store on
node 0 is handed a socket bound to the endpoint's host (as prl/weights/collective.py does for the weight feeds'
stores), then runs torchrun (`torch.distributed.run`) with the arguments it was given. The job starts the trainer with it
(prl/job/runtimes.py):

    python -m prl.trainer.torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=prl-static \\
        --rdzv-endpoint=10.0.0.5:29500 --rdzv-conf=rank=1 -m prl.trainer --run-dir RUN

Everything else is torchrun's own: the ranks connect to the agent's store, signals reach the ranks, a
failed rank stops the others. Like torch.distributed's groups, the store carries no key (what that exposes, and
why it is bounded to the job's nodes: docs/run-directory.md, Listeners).
"""

from __future__ import annotations

import socket
import sys

from prl.errors import ConfigError, run_entry
from prl.planner.model import RENDEZVOUS_BACKEND


def listening_socket(host: str, port: int) -> int:
    """A listening TCP socket bound to `host`:`port` only (address reuse on, as TCPStore sets), as a file
    descriptor the caller owns."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(1024)
    except OSError:
        listener.close()
        raise
    return listener.detach()


def create_handler(params):
    """torchrun's rendezvous handler for RENDEZVOUS_BACKEND (`--rdzv-conf=rank=N` is this node's rank)."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous

    class BoundStaticRendezvous(static_tcp_rendezvous.StaticTCPRendezvous):
        def get_backend(self) -> str:
            return RENDEZVOUS_BACKEND

        def next_rendezvous(self):
            if self._store is None and self.rank == 0:  # the arguments static rendezvous gives, plus the socket
                self._store = TCPStore(self.master_addr, self.master_port, self.world_size, True, self.timeout,
                                       multi_tenant=True,
                                       master_listen_fd=listening_socket(self.master_addr, self.master_port))
            return super().next_rendezvous()

    try:
        params.config["rank"] = int(params.config.get("rank", ""))
    except ValueError:
        raise ConfigError(f"--rdzv-backend={RENDEZVOUS_BACKEND} needs --rdzv-conf=rank=N (this node's rank), "
                          f"got {params.config.get('rank')!r}") from None
    static = static_tcp_rendezvous.create_rdzv_handler(params)
    return BoundStaticRendezvous(static.master_addr, static.master_port, static.rank, static.world_size,
                                 static.run_id, int(static.timeout.total_seconds()))


def main(argv: list[str]) -> None:
    from torch.distributed import run
    from torch.distributed.elastic.rendezvous import registry

    registry.handler_registry.register(RENDEZVOUS_BACKEND, create_handler)
    run.main(argv)


if __name__ == "__main__":
    sys.exit(run_entry("prl trainer.torchrun", lambda: main(sys.argv[1:])))
