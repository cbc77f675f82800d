"""How long one weight update takes: a published file against vLLM's transfer protocol (gloo).

One `vllm serve` server of the bundled SmolLM2-135M (fp32, 135M parameters, 0.54 GB) starts
with `--weight-transfer-config '{"backend": "gloo"}'`, which also takes file updates, and
one `VLLMHttpEngine` per transfer talks to it. Each round updates the weights through both,
in alternating order (the machine's load drifts over both alike); each update sends a
different perturbation of the checkpoint and is checked by the parity probe, so an update
that did not land fails the run instead of timing nothing. The table gives the median
seconds per update and its ratio to the file path.

    python bench/weight_transfer.py                     # 5 rounds
    python bench/weight_transfer.py --rounds 9 --record bench/weight_transfer_records/x.txt

On this machine both sides share two cores and the "wire" is loopback, so what the table
shows is the cost of each path's work (serialise, write, read and load a safetensors file,
against a broadcast of raw buffers), not what NCCL does between GPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tir_rl.distributed import free_port
from tir_rl.engine.parity import probe_ids_from_text, probe_parity
from tir_rl.engine.vllm_http import VLLMHttpEngine, serve_command
from tir_rl.engine.vllm_local import VLLMLocalEngine
from tir_rl.engine.weights.transfer import WeightTransfer
from tir_rl.launch import ServerPlan, new_run_secret, running_servers
from tir_rl.models import resolve_model

TRANSFERS = (WeightTransfer.FILE, WeightTransfer.GLOO)


def perturb(model: torch.nn.Module, base: list[torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Set `model`'s parameters to `base` plus noise; its state dict (tied weights stay tied)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param, start in zip(model.parameters(), base, strict=True):
            param.copy_(start + 1e-3 * start.std() * torch.randn(start.shape, generator=gen))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def measure(
    url: str, key_file: Path, work: Path, hf: torch.nn.Module, probe: list[int], rounds: int
):
    """Seconds per update of each transfer, alternated round by round on the server at `url`."""
    base = [p.detach().clone() for p in hf.parameters()]
    seconds: dict[WeightTransfer, list[float]] = {t: [] for t in TRANSFERS}
    engines = {
        t: VLLMHttpEngine(
            VLLMHttpEngine.Config(
                base_url=url,
                api_key_file=str(key_file),
                weight_transfer=t,
                weights_dir=str(work / "w"),
            )
        )
        for t in TRANSFERS
    }
    try:
        seed = 0
        for round_ in range(rounds + 1):  # round 0 warms both paths up, untimed
            for transfer in TRANSFERS if round_ % 2 == 0 else TRANSFERS[::-1]:
                seed += 1
                state = perturb(hf, base, seed)
                start = time.perf_counter()
                asyncio.run(engines[transfer].update_weights(state, version=seed))
                took = time.perf_counter() - start
                parity = asyncio.run(probe_parity(engines[transfer], hf, probe, tolerance=1e-3))
                assert parity.passed, parity
                if round_ > 0:
                    seconds[transfer].append(took)
    finally:
        for engine in engines.values():
            engine.close()
    return seconds


def table(name: str, params: int, rounds: int, seconds: dict[WeightTransfer, list[float]]) -> str:
    file_median = statistics.median(seconds[WeightTransfer.FILE])
    lines = [
        f"weight update of {name} ({params / 1e6:.0f}M parameters, fp32, "
        f"{params * 4 / 1e9:.2f} GB) to one vllm serve on loopback; {rounds} rounds",
        "",
        "| transfer | median s | min s | max s | ratio to file |",
        "|---|---|---|---|---|",
    ]
    for transfer in TRANSFERS:
        s = seconds[transfer]
        lines.append(
            f"| {transfer.value} | {statistics.median(s):.2f} | {min(s):.2f} | {max(s):.2f} | "
            f"{statistics.median(s) / file_median:.2f} |"
        )
    lines += ["", "every update passed the parity probe (max |Δ| < 1e-3)"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--record", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model("bundled")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    probe = probe_ids_from_text(AutoTokenizer.from_pretrained(path))
    params = sum(p.numel() for p in hf.parameters())
    server = VLLMLocalEngine.Config(
        model_path=str(path), max_model_len=512, kv_cache_gib=0.25, max_num_seqs=8,
        weight_transfer=WeightTransfer.GLOO,  # such a server takes file updates too
    )  # fmt: skip
    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="tir-rl-bench-wt-", dir="/dev/shm"))
    plan = ServerPlan(
        url=f"http://127.0.0.1:{port}",
        command=serve_command(server, port=port, python=sys.executable),
        log=work / "server.log",
    )
    try:
        key_file = new_run_secret(work)
        with running_servers([plan], key_file):
            seconds = measure(plan.url, key_file, work, hf, probe, args.rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = table(path.name, params, args.rounds, seconds)
    print(text)
    if args.record is not None:
        args.record.parent.mkdir(parents=True, exist_ok=True)
        args.record.write_text(text + "\n")


if __name__ == "__main__":
    main()
