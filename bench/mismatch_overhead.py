"""Overhead of mismatch metrics + correction relative to a training step's loss fwd/bwd.

The step is: model forward over prompt + completion, logprobs of the completion tokens,
GRPOLoss, backward. The mismatch work is `mismatch_metrics` + `correction` (recommended
preset) on the same [B, T] completion tensors, with multi-turn masks and turn ids.

The model keeps float32 weights; `--dtype` other than float32 runs the forward under autocast
(the trainer's mixed precision); logprobs are float32. The step's model FLOPs utilisation is
reported beside its time (bench/mfu.py).

    python bench/mismatch_overhead.py                 # tiny Llama (default)
    python bench/mismatch_overhead.py --model bundled --batch 4 --completion 256
    python bench/mismatch_overhead.py --model bundled --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import mfu
import torch

from tir_rl.mismatch import MismatchCorrection, correction, mismatch_metrics
from tir_rl.models import prepare_bundled_model, prepare_tiny_model
from tir_rl.trainer.loss import GRPOLoss


def multi_turn_layout(batch: int, length: int, *, num_turns: int, tool_len: int):
    """loss_mask and turn_ids with `num_turns` turns separated by tool blocks."""
    mask = torch.ones(batch, length)
    turns = torch.zeros(batch, length, dtype=torch.long)
    turn_len = length // num_turns
    for k in range(num_turns):
        start = k * turn_len
        turns[:, start:] = k
        if k > 0:
            mask[:, start : start + tool_len] = 0
            turns[:, start : start + tool_len] = k - 1
    mask[batch // 2 :, -length // 4 :] = 0  # shorter episodes: padding
    return mask, turns


def median_s(fn, reps: int, device: torch.device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        mfu.synchronize(device)
        start = time.perf_counter()
        fn()
        mfu.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "bundled"], default="tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--completion", type=int, default=448)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--dtype", choices=list(mfu.DTYPES), default="float32")
    parser.add_argument("--peak-tflops", type=float, default=None, help="MFU denominator")
    args = parser.parse_args()
    device = mfu.pick_device(args.device)

    from transformers import AutoModelForCausalLM

    path = prepare_tiny_model() if args.model == "tiny" else prepare_bundled_model()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    model.train()
    compute = mfu.DTYPES[args.dtype]
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    batch, prompt, completion = args.batch, args.prompt, args.completion
    input_ids = torch.randint(0, vocab, (batch, prompt + completion), generator=gen).to(device)
    loss_mask, turn_ids = multi_turn_layout(batch, completion, num_turns=4, tool_len=24)
    loss_mask, turn_ids = loss_mask.to(device), turn_ids.to(device)
    advantages = torch.randn(batch, generator=gen).to(device)
    loss_fn = GRPOLoss()

    def completion_logprobs() -> torch.Tensor:
        autocast = (
            contextlib.nullcontext()
            if compute == torch.float32
            else torch.autocast(device_type=device.type, dtype=compute)
        )
        with autocast:
            logits = model(input_ids=input_ids).logits
        logits = logits[:, prompt - 1 : -1].float()
        targets = input_ids[:, prompt:]
        return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    with torch.no_grad():
        old = completion_logprobs()
    sampler = old + 0.03 * torch.randn(old.shape, generator=gen).to(device)
    sampler[loss_mask == 0] = 0.0
    config = MismatchCorrection.Config.preset("geo_rs_token_tis")

    def step() -> None:
        model.zero_grad(set_to_none=True)
        logprobs = completion_logprobs()
        loss, _ = loss_fn(logprobs, old_logprobs=old, advantages=advantages, loss_mask=loss_mask)
        loss.backward()

    def mismatch() -> None:
        mismatch_metrics(old, sampler, loss_mask, turn_ids)
        result = correction(old, sampler, loss_mask, turn_ids, config)
        result.stats.to_dict()

    step_s = median_s(step, args.reps, device)
    mismatch_s = median_s(mismatch, args.reps * 4, device)
    peak, peak_source = mfu.peak_tflops(device, args.dtype, args.peak_tflops)
    flops = mfu.model_flops(model, [prompt + completion] * batch, backward=True)
    rows = [
        ("model", args.model),
        ("device, compute dtype", f"{device}, {args.dtype}"),
        ("batch x (prompt + completion)", f"{batch} x ({prompt} + {completion})"),
        ("torch threads", str(torch.get_num_threads())),
        ("loss fwd+bwd step (ms)", f"{step_s * 1e3:.1f}"),
        (
            f"step MFU (peak {peak:.3g} TFLOP/s, {peak_source})",
            f"{100 * flops / step_s / (peak * 1e12):.1f}%",
        ),
        ("mismatch metrics + correction (ms)", f"{mismatch_s * 1e3:.2f}"),
        ("overhead ratio (mismatch / step)", f"{100 * mismatch_s / step_s:.2f}%"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"| {'quantity'.ljust(width)} | value |")
    print(f"| {'-' * width} | ----- |")
    for key, value in rows:
        print(f"| {key.ljust(width)} | {value} |")


if __name__ == "__main__":
    main()
