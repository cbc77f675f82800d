"""How a run re-runs itself under torchrun: this node's place in the job, and the command.

`tir-rl train --nproc-per-node N` (and `--nnodes` with `--node-rank`) starts N ranks per
node through `python -m torch.distributed.run`; `Nodes` checks a multi-node job's flags
and `torchrun_command` builds the command line. The ranks then coordinate through
`tir_rl.distributed`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from tir_rl.errors import ConfigError


@dataclass(frozen=True)
class Nodes:
    """Where this node stands in a multi-node job (torchrun's static rendezvous)."""

    count: int
    """Nodes in the job, each running `nproc_per_node` ranks."""
    rank: int
    """This node's index; node 0 holds global rank 0 (the engine, the driver)."""
    master_addr: str
    """Node 0's address as every node reaches it."""
    master_port: int

    def __post_init__(self) -> None:
        if self.count < 2:
            raise ConfigError(f"--nnodes {self.count}: a multi-node job has 2 nodes or more")
        if not 0 <= self.rank < self.count:
            raise ConfigError(f"--node-rank {self.rank} is not in 0..{self.count - 1}")
        if not self.master_addr or not 0 < self.master_port < 65536:
            raise ConfigError(
                "a multi-node job needs --master-addr (node 0's address) and --master-port"
            )

    def torchrun_flags(self) -> list[str]:
        """The flags that place this node in torchrun's rendezvous."""
        return [
            f"--nnodes={self.count}",
            f"--node-rank={self.rank}",
            f"--master-addr={self.master_addr}",
            f"--master-port={self.master_port}",
        ]


def torchrun_command(
    nproc_per_node: int, module: str, args: Sequence[str], *, nodes: Nodes | None = None
) -> list[str]:
    """`python -m torch.distributed.run` starting `nproc_per_node` local ranks of `module`.

    Single-node without `nodes` (`--standalone`: a free rendezvous port is picked); with
    `nodes`, this node's part of a multi-node job (static rendezvous at node 0). Each rank
    runs `python -m module *args`.
    """
    where = nodes.torchrun_flags() if nodes is not None else ["--standalone"]
    return [
        sys.executable, "-m", "torch.distributed.run", *where,
        f"--nproc-per-node={nproc_per_node}", "-m", module, *args,
    ]  # fmt: skip
