"""Rebalance the written lab model's weight pairs without changing its function (an experiment).

The written circuit writes small values and reads them with large gains (docs/lab_model.md,
"Training more than the logit scale"), so one AdamW step, which moves every weight by about
the learning rate, breaks it. Three products are linear in each factor and can be rescaled
exactly (up to fp32 rounding):

- per attention score dimension pair (the two dimensions RoPE rotates together): q rows × a,
  k rows ÷ a, with a making their largest entries equal;
- per value dimension: v row × b, the matching o_proj column ÷ b;
- per MLP unit: up_proj row × c, the matching down_proj column ÷ c (SiLU sits on the gate,
  which is left alone).

    python bench/lab_rebalance.py OUT_DIR     # writes the rebalanced model, checks its logits
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch


def balance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row scale s so that max|a_i · s| == max|b_i / s| (1 where either row is zero)."""
    ma, mb = a.abs().amax(dim=1), b.abs().amax(dim=1)
    scale = torch.ones_like(ma)
    ok = (ma > 0) & (mb > 0)
    scale[ok] = (mb[ok] / ma[ok]).sqrt()
    return scale


def rebalance(state: dict[str, torch.Tensor], num_layers: int, heads: int, head_dim: int) -> None:
    """Rescale `state` in place (see the module docstring)."""
    half = head_dim // 2
    for layer in range(num_layers):
        p = f"model.layers.{layer}."
        q, k = state[p + "self_attn.q_proj.weight"], state[p + "self_attn.k_proj.weight"]
        for h in range(heads):
            rows = slice(h * head_dim, (h + 1) * head_dim)
            qh, kh = q[rows], k[rows]
            pair_q = torch.cat([qh[:half], qh[half:]], dim=1)  # RoPE pairs (i, i + half)
            pair_k = torch.cat([kh[:half], kh[half:]], dim=1)
            s = balance(pair_q, pair_k).repeat(2)
            q[rows] *= s[:, None]
            k[rows] /= s[:, None]
        v, o = state[p + "self_attn.v_proj.weight"], state[p + "self_attn.o_proj.weight"]
        s = balance(v, o.T)
        v *= s[:, None]
        o /= s[None, :]
        up, down = state[p + "mlp.up_proj.weight"], state[p + "mlp.down_proj.weight"]
        s = balance(up, down.T)
        up *= s[:, None]
        down /= s[None, :]


def main() -> None:  # noqa: D103
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from tir_rl.lab.model import LabModelSpec
    from tir_rl.models import prepare_lab_model

    with tempfile.TemporaryDirectory() as tmp:
        src = prepare_lab_model(LabModelSpec(), Path(tmp) / "lab")
        shutil.copytree(src, args.out, dirs_exist_ok=True)
    (shard,) = sorted(args.out.glob("*.safetensors"))
    state = {k: v.clone() for k, v in load_file(shard).items()}
    before = {k: v.abs().max().item() for k, v in state.items()}
    model = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval()
    ids = torch.randint(0, 2000, (1, 300))
    with torch.no_grad():
        reference = model(ids).logits
    config = model.config
    rebalance(state, config.num_hidden_layers, config.num_attention_heads, config.head_dim)
    save_file(state, shard, metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval()
    with torch.no_grad():
        diff = (model(ids).logits - reference).abs().max().item()
    print(f"largest logit change: {diff:.2e}")
    for name, value in state.items():
        if "layers" in name and not name.endswith("norm.weight"):
            print(f"{name:45s} max abs {before[name]:9.3g} -> {value.abs().max().item():9.3g}")


if __name__ == "__main__":
    main()
