"""The lab model's initialisation: a small Llama whose first two layers copy from context.

Agent tasks at lab scale (MultiHop) are mostly copying: the next tool call names the entity the
last tool result returned. A small decoder trained from a random init on this machine's budget
never learned to copy (every from-scratch run stayed at turn accuracy 0). The mechanism that
copies in trained transformers is known (an induction circuit: a previous-token head feeding an
induction head), so the lab model starts with one written into its weights and SFT only has to
learn *where* to copy from and which relation to ask for.

Residual stream layout (hidden size d ≥ 256, head size 64):

    [0, 64)    token code: a fixed random vector per token, norm 8 (embedding)
    64         constant 1 (embedding): the previous-token head's query and key read it
    [65, 129)  previous token's code, written by layer 0 head 0
    [129, 193) predicted next token's code, written by layer 1 head 0 and read by lm_head
    [193, d)   free: a fixed random vector per token, for the layers SFT trains

Layer 0 head 0 attends to the previous position: its query and key are constant and the key is
pre-rotated by one position on the fastest rotary frequencies, so the score peaks at offset 1.
Layer 1 head 0 is the induction head: its query is the current token's code and its key the
previous-token code, on the slowest rotary frequencies (position-free with a large rope_theta),
so it attends to the position after an earlier occurrence of the current token and copies that
position's token code into the output subspace, which lm_head (rows = token codes) turns into
logits. Every other weight is random (std `init_std`) and trainable; the embedding and lm_head
stay frozen so the codes keep their meaning (`FROZEN_PARAMETERS`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tir_rl.errors import ConfigError

TOKEN_CODE = slice(0, 64)
CONSTANT = 64
PREVIOUS_CODE = slice(65, 129)
OUTPUT_CODE = slice(129, 193)
FREE = 193
HEAD_SIZE = 64
CODE_SIZE = 64

FROZEN_PARAMETERS = ("model.embed_tokens.weight", "lm_head.weight")
"""Parameters training must leave alone: they hold the token codes the circuit relies on."""


@dataclass(frozen=True, kw_only=True)
class LabModelSpec:
    """Shape, seed and circuit strengths of the lab model."""

    hidden_size: int = 256
    num_layers: int = 4
    intermediate_size: int = 768
    rope_theta: float = 1e8
    """Large, so the slowest rotary pairs barely turn over a 4K context (position-free keys)."""
    max_positions: int = 4096
    init_std: float = 0.02
    """Std of every weight outside the circuit (0: zero, for a circuit-only model)."""
    seed: int = 0
    previous_token_gain: float = 6.0
    """Query/key strength of the previous-token head (sharpness of its offset-1 peak)."""
    previous_token_pairs: int = 6
    """How many of the fastest rotary pairs the previous-token head uses."""
    induction_gain: float = 3.0
    """Query/key strength of the induction head (sharpness of its match)."""
    induction_pairs: int = 16
    """How many of the slowest rotary pairs the induction head uses."""
    previous_code_gain: float = 1.0
    output_code_gain: float = 2.0
    token_code_norm: float = 8.0

    @property
    def num_heads(self) -> int:
        """Attention heads: the head size is fixed at 64 (the circuit's code width)."""
        return self.hidden_size // HEAD_SIZE

    @property
    def dirname(self) -> str:
        """Folder name that identifies the initialisation in the cache."""
        shape = f"d{self.hidden_size}-l{self.num_layers}-i{self.intermediate_size}"
        return f"lab-init-{shape}-s{self.seed}"

    def validate(self) -> None:
        """Refuse shapes the circuit does not fit in."""
        if self.hidden_size % HEAD_SIZE or self.hidden_size < 4 * HEAD_SIZE:
            raise ConfigError(
                f"lab model hidden_size {self.hidden_size}: must be a multiple of {HEAD_SIZE} "
                f"and at least {4 * HEAD_SIZE} (the circuit's subspaces take {FREE} dimensions)"
            )
        if self.num_layers < 2:
            raise ConfigError("lab model num_layers must be at least 2 (the circuit uses two)")
        half = HEAD_SIZE // 2
        if self.previous_token_pairs + self.induction_pairs > half:
            raise ConfigError(
                f"previous_token_pairs + induction_pairs must be at most {half} rotary pairs"
            )


def build_lab_model(spec: LabModelSpec, *, vocab_size: int, bos_token_id: int, eos_token_id: int):
    """A `LlamaForCausalLM` with the copy circuit written in (deterministic for `spec.seed`)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec.validate()
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=False,
        rope_theta=spec.rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        torch_dtype="float32",
    )
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, spec.init_std, generator=gen) if spec.init_std else param.zero_()
        _write_codes(model, spec, gen)
        _write_previous_token_head(model.model.layers[0].self_attn, spec)
        _write_induction_head(model.model.layers[1].self_attn, spec, gen)
    return model


def _fixed_norm_rows(rows: int, cols: int, norm: float, gen):
    import torch

    codes = torch.randn(rows, cols, generator=gen)
    return codes / codes.norm(dim=1, keepdim=True) * norm


def _write_codes(model, spec: LabModelSpec, gen) -> None:
    vocab = model.config.vocab_size
    codes = _fixed_norm_rows(vocab, CODE_SIZE, spec.token_code_norm, gen)
    free = spec.hidden_size - FREE
    embedding = model.model.embed_tokens.weight
    embedding.zero_()
    embedding[:, TOKEN_CODE] = codes
    embedding[:, CONSTANT] = 1.0
    embedding[:, FREE:] = _fixed_norm_rows(vocab, free, math.sqrt(free), gen)
    head = model.lm_head.weight
    head.zero_()
    head[:, OUTPUT_CODE] = codes
    for layer in model.model.layers[:2]:  # head 0 of each circuit layer starts clean
        attn = layer.self_attn
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            proj.weight[:HEAD_SIZE] = 0.0
        attn.o_proj.weight[:, :HEAD_SIZE] = 0.0


def _inverse_frequencies(spec: LabModelSpec):
    import torch

    return 1.0 / (spec.rope_theta ** (torch.arange(0, HEAD_SIZE, 2).float() / HEAD_SIZE))


def _copy_token_code(attn, into: slice, gain: float) -> None:
    for j in range(CODE_SIZE):
        attn.v_proj.weight[j, TOKEN_CODE.start + j] = 1.0
        attn.o_proj.weight[into.start + j, j] = gain


def _write_previous_token_head(attn, spec: LabModelSpec) -> None:
    # Llama's rotary embedding pairs dimension i with i + HEAD_SIZE/2. A key pre-rotated by one
    # step of pair i makes q·k largest when the key sits one position before the query.
    half = HEAD_SIZE // 2
    inv = _inverse_frequencies(spec)
    a = spec.previous_token_gain
    for i in range(spec.previous_token_pairs):
        attn.q_proj.weight[i, CONSTANT] = a
        attn.k_proj.weight[i, CONSTANT] = a * math.cos(float(inv[i]))
        attn.k_proj.weight[i + half, CONSTANT] = a * math.sin(float(inv[i]))
    _copy_token_code(attn, PREVIOUS_CODE, spec.previous_code_gain)


def _write_induction_head(attn, spec: LabModelSpec, gen) -> None:
    import torch

    half = HEAD_SIZE // 2
    n = spec.induction_pairs
    slow_dims = [*range(half - n, half), *range(HEAD_SIZE - n, HEAD_SIZE)]
    mix = torch.randn(2 * n, CODE_SIZE, generator=gen) / math.sqrt(CODE_SIZE)
    b = spec.induction_gain
    for row, dim in enumerate(slow_dims):
        attn.q_proj.weight[dim, TOKEN_CODE] = b * mix[row]
        attn.k_proj.weight[dim, PREVIOUS_CODE] = b * mix[row]
    _copy_token_code(attn, OUTPUT_CODE, spec.output_code_gain)


def copy_accuracy(model, *, context: int, span: int, rows: int = 8, seed: int = 0) -> float:
    """Greedy accuracy at repeating a random `span` seen once earlier in a random `context`.

    Each row is random tokens with one span planted twice (after the same marker token); the
    score is over the second copy's tokens. 1.0 means the circuit copies.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    low = min(1000, vocab // 2)
    ids = torch.randint(low, vocab, (rows, context), generator=gen)
    scored = torch.zeros(rows, context, dtype=torch.bool)
    marker = low - 1
    for r in range(rows):
        text = torch.randint(low, vocab, (span,), generator=gen)
        first = int(torch.randint(1, context // 2 - span, (), generator=gen))
        second = int(torch.randint(context // 2, context - span - 1, (), generator=gen))
        ids[r, first - 1] = marker
        ids[r, first : first + span] = text
        ids[r, second] = marker
        ids[r, second + 1 : second + 1 + span] = text
        scored[r, second + 1 : second + 1 + span] = True
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
    predicted = logits.argmax(-1)[scored[:, 1:]]
    return float((predicted == ids[:, 1:][scored[:, 1:]]).float().mean())
