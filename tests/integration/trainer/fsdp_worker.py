"""One rank of the FSDP2 equivalence test (run by test_fsdp.py as a subprocess).

Usage: python fsdp_worker.py OUT_DIR RANK WORLD_SIZE PORT MODEL_PATH [KL_COEF [PACKING BATCH]]

With KL_COEF > 0 the loss has a KL penalty to the frozen reference (sharded like the policy),
and the worker takes two steps (the KL is 0 at the first) and saves the reference's weights.
PACKING is the trainer's layout (default packed); BATCH `groups` trains on GRPO groups that
share prompts (`make_group_batch`, groups straddling the ranks) instead of the default batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from trainer_helpers import make_batch, make_group_batch

from tir_rl import distributed as tdist
from tir_rl.trainer import Packing, Trainer, checkpoint
from tir_rl.trainer.loss import GRPOLoss, LossTerms

# Rank 0's half is short (one packed row), rank 1's is long (several rows), so the ranks run
# different numbers of micro-batches and the empty passes are exercised.
SHAPES = ((3, [4]), (2, [3]), (10, [12, 9]), (8, [14]))
ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.25])
GROUPS = ((12, 3), (7, 3), (9, 2))
"""Rank 0 gets the first group and one sample of the second, rank 1 the rest."""


def main(
    out: Path,
    rank: int,
    world_size: int,
    port: int,
    model: str,
    kl_coef: float,
    packing: Packing = Packing.PACKED,
    groups: bool = False,
) -> None:
    # One GPU per rank when there are enough, else CPU; the backend follows the device.
    use_cuda = torch.cuda.device_count() >= world_size
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    tdist.init_process_group(device=device, rank=rank, world_size=world_size, master_port=port)
    config = Trainer.Config(
        model=model, lr=1e-3, micro_batch_tokens=24, device=str(device), packing=packing
    )
    trainer = Trainer(config, loss_fn=GRPOLoss(terms=LossTerms(kl_coef=kl_coef)))
    assert trainer.sharded == (world_size > 1)
    if trainer.reference is not None and trainer.sharded:
        from torch.distributed.tensor import DTensor

        assert all(isinstance(p, DTensor) for p in trainer.reference.model.parameters())
    batch = make_group_batch(seed=1, groups=GROUPS) if groups else make_batch(seed=1, shapes=SHAPES)
    advantages = torch.linspace(-1.0, 1.0, batch.num_sequences) if groups else ADVANTAGES
    per = batch.num_sequences // world_size
    for _ in range(2 if kl_coef > 0 else 1):
        result = trainer.train_step(
            batch.shard(rank, world_size), advantages[rank * per : (rank + 1) * per]
        )
    state = trainer.rank0_full_state_dict()
    reference_state = (
        tdist.full_model_state_dict(trainer.reference.model) if trainer.reference else {}
    )
    path = checkpoint.save(out / "ckpt", trainer, data_position=3)
    resumed = checkpoint.load(path, trainer)
    assert resumed.data_position == 3
    if rank == 0:
        torch.save({"state": state, "loss": result.loss, "grad_norm": result.grad_norm,
                    "metrics": result.metrics, "reference_state": reference_state},
                   out / "result.pt")  # fmt: skip
    else:
        assert state == {}
    tdist.destroy_process_group()


if __name__ == "__main__":
    out_dir, rank_, world, port_, model_path = sys.argv[1:6]
    kl = float(sys.argv[6]) if len(sys.argv) > 6 else 0.0
    layout = Packing(sys.argv[7]) if len(sys.argv) > 7 else Packing.PACKED
    grouped = len(sys.argv) > 8 and sys.argv[8] == "groups"
    main(Path(out_dir), int(rank_), int(world), int(port_), model_path, kl, layout, grouped)
