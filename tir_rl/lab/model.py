"""The lab model: MultiHop's policy written into the weights of a three-layer Llama.

Training a small decoder from scratch on this machine never taught it to copy an entity name
from a tool result (docs/lab_model.md), so the lab model is not trained: every weight is set
by hand, the way a compiler would lay out a program. It is a plain `LlamaForCausalLM` (hidden
size 256, 4 heads of size 128, 3 layers, the bundled tokenizer and chat template) that vLLM
serves like any checkpoint, and it plays `tir_rl/MultiHop-v0` greedily without a mistake at
horizons 1-9. `LabModelSpec.logit_scale` (the final RMSNorm's weight) then scales every logit
down, so that at temperature 1 a sampled episode fails often enough for RL to have something
to learn: GRPO must discover that being more confident pays.

How one call is produced (residual subspaces below):

- layer 0 attention: heads at fixed offsets 1-4 write the previous two tokens' codes and flags
  for "3 back is `response`", "3 back is `relation`", "4 back is `</`"; its MLP turns these
  into flags: the first token of a tool result's name, of the question's start entity, the
  entity and relation slots of a call, the opening `<` of a turn, a numbered line of the
  question, an `<answer>` opening.
- layer 1 attention: a head counts tool results so far (it attends evenly to position 0 and to
  every tool result's first name token; value 1 at position 0 only, so it reads 1/(1+n));
  its MLP turns the count into one-hot codes for n and n+1. Another head sets "an answer is
  open".
- layer 2 attention: the entity head fetches the first token of the latest name (the tool
  result, or the start entity, in the current count's segment) at an entity slot; the
  relation head fetches line n+1 of the question at a relation slot; the done head sees that
  line n+1 does not exist at a turn's opening `<`; the induction head continues a name from
  its source in the current segment. Its MLP is the grammar of a call and of an answer.

Outside a slot, the fetch heads attend to `<|im_start|>` tokens, whose value is projected to
zero. The model writes the start entity and the relation with the question's leading space
(`" Ada Marsh"`, `" mentor"`); the tools strip whitespace, so the calls are valid.
Limits: at most 9 relations (the question numbers its lines with one digit), MultiHop's
system prompt and question wording, and names of at most a few dozen tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tir_rl.errors import ConfigError

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

HIDDEN = 256
HEAD_SIZE = 128
NUM_HEADS = 4
NUM_LAYERS = 3
CODE = 48
"""Width of a token code; the 48 structural tokens get orthonormal codes."""
CODE_NORM = 8.0
ROPE_THETA = 1e10
"""Large, so rotary pairs 32-63 barely turn over a long episode (position-free content)."""
MAX_HORIZON = 9
MAX_COUNT = 11

TOK = slice(0, 48)
ONE = 48
P1 = slice(49, 97)
P2 = slice(97, 145)
OUT = slice(145, 193)
ORD = slice(193, 205)
ORD_NEXT = slice(205, 217)
LINE = slice(217, 229)
FLAG = {
    name: 229 + i
    for i, name in enumerate(
        (
            "back3_response",
            "back3_relation",
            "back4_close",
            "position0",
            "result_name",
            "start_name",
            "entity_slot",
            "relation_slot",
            "turn_open",
            "numbered_line",
            "answer_open",
            "count",
            "in_answer",
            "done",
        )
    )
}
FAST_PAIRS = range(6)
FREE_DIMS = [*range(32, 64), *range(96, 128)]
"""Head dimensions on rotary pairs 32-63: position-free over 10K tokens at ROPE_THETA."""

RELATION_TOKENS = (
    " employer",
    " founder",
    " headquarters",
    " hometown",
    " mayor",
    " mentor",
    " partner",
    " rival",
)
STRUCTURAL_TOKENS = (
    "<",
    "tool",
    "_",
    "call",
    ">",
    "\n",
    '{"',
    "name",
    '":',
    ' "',
    "lookup",
    '",',
    "arguments",
    ' {"',
    "entity",
    "relation",
    '"',
    "}}",
    "</",
    "answer",
    "<|im_end|>",
    "<|im_start|>",
    "ass",
    "istant",
    "response",
    " from",
    "Start",
    ".",
    " (",
    *map(str, range(1, 10)),
    " twin",
    "city",
    *RELATION_TOKENS,
)


CIRCUIT_VERSION = 1
"""Bump whenever the written weights change for the same spec: the cache folder is named by
it, so a model built by older code is never reused."""


@dataclass(frozen=True, kw_only=True)
class LabModelSpec:
    """The lab model's seed and how confident its sampled policy is."""

    seed: int = 0
    """Seed of the random codes of the non-structural tokens."""
    logit_scale: float = 0.43
    """Weight of the final RMSNorm: 1.0 plays almost perfectly at temperature 1; lower values
    make sampled episodes fail more. Held-out pass@1 at temperature 1 (docs/lab_model.md):
    0.43 gives 0.59 / 0.41 / 0.19 at horizons 2 / 4 / 8; 0.45 gives 0.28 at horizon 8."""
    output_gain: float = 0.5
    """Strength of one written output code before the logit scale."""

    @property
    def dirname(self) -> str:
        """Folder name that identifies the model in the cache."""
        return (
            f"lab-multihop-c{CIRCUIT_VERSION}-s{self.seed}-ls{self.logit_scale:g}"
            f"-g{self.output_gain:g}"
        )

    def validate(self) -> None:
        """Refuse values the circuit cannot work with."""
        if not 0.05 <= self.logit_scale <= 4.0:
            raise ConfigError(f"lab model logit_scale {self.logit_scale}: choose 0.05..4")
        if not 0.05 <= self.output_gain <= 4.0:
            raise ConfigError(f"lab model output_gain {self.output_gain}: choose 0.05..4")


BUILD_STAGES = ("write the circuit", "measure the count levels", "rewrite the count codes")
"""What `build_lab_model` reports to `on_stage`, in order, each when it is about to start."""


def build_lab_model(
    tokenizer: PreTrainedTokenizerBase,
    spec: LabModelSpec,
    *,
    on_stage: Callable[[str], None] | None = None,
) -> LlamaForCausalLM:
    """The lab model for `tokenizer` (the bundled one), deterministic for `spec`.

    `on_stage` is called with each of `BUILD_STAGES` as it starts (for a progress bar).
    """
    spec.validate()
    report = on_stage or (lambda _stage: None)
    report(BUILD_STAGES[0])
    circuit = _Circuit(tokenizer, spec)
    report(BUILD_STAGES[1])
    levels = circuit.measure_count_levels(tokenizer)
    report(BUILD_STAGES[2])
    circuit.write_count_codes(levels)
    return circuit.model


class _Circuit:
    """Writes the weights; the count codes start from estimated count levels."""

    def __init__(self, tokenizer, spec: LabModelSpec) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        self.ids = {}
        for text in STRUCTURAL_TOKENS:
            encoded = tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) != 1:
                raise ConfigError(f"the lab model needs {text!r} to be one token of the tokenizer")
            self.ids[text] = encoded[0]
        vocab = len(tokenizer)
        gen = torch.Generator().manual_seed(spec.seed)
        codes = torch.randn(vocab, CODE, generator=gen)
        basis, _ = torch.linalg.qr(torch.randn(CODE, CODE, generator=gen))
        codes[torch.tensor(list(self.ids.values()))] = basis[: len(self.ids)]
        self.codes = codes / codes.norm(dim=1, keepdim=True) * CODE_NORM
        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=HIDDEN,
            intermediate_size=128,
            num_hidden_layers=NUM_LAYERS,
            num_attention_heads=NUM_HEADS,
            num_key_value_heads=NUM_HEADS,
            head_dim=HEAD_SIZE,
            max_position_embeddings=8192,
            tie_word_embeddings=False,
            rope_theta=ROPE_THETA,
            rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
            rms_norm_eps=1e-6,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            torch_dtype="float32",
        )
        with torch.random.fork_rng():
            torch.manual_seed(spec.seed)
            self.model = LlamaForCausalLM(config).eval()
        self.inverse_frequencies = 1.0 / (
            ROPE_THETA ** (torch.arange(0, HEAD_SIZE, 2).float() / HEAD_SIZE)
        )
        # 1/RMS^2 of the residual at each MLP's input (fixed-norm codes keep it near constant)
        self.mlp_input_scale = [HIDDEN / 193.0, HIDDEN / 194.0, 1.0]
        self.units_used = [0] * NUM_LAYERS
        self.gain = spec.output_gain
        with torch.no_grad():
            for param in self.model.parameters():
                if param.dim() == 2:
                    param.zero_()
            self._write(spec)
            for layer in self.model.model.layers:  # undo attention's 1/sqrt(head size)
                layer.self_attn.q_proj.weight *= math.sqrt(HEAD_SIZE)

    # ------------------------------------------------------------------ residual vectors
    def code(self, text: str):
        return self.codes[self.ids[text]]

    def reads(self, space: slice, text: str):
        """A read vector that gives 1 (before RMSNorm) where `space` holds `text`'s code."""
        import torch

        v = torch.zeros(HIDDEN)
        v[space] = self.code(text) / CODE_NORM**2
        return v

    def axis(self, index: int, weight: float = 1.0):
        import torch

        v = torch.zeros(HIDDEN)
        v[index] = weight
        return v

    def flag(self, name: str, weight: float = 1.0):
        return self.axis(FLAG[name], weight)

    def emits(self, text: str, gain: float):
        import torch

        v = torch.zeros(HIDDEN)
        v[OUT] = self.code(text) * gain
        return v

    # ------------------------------------------------------------------ attention pieces
    def attention(self, layer: int):
        return self.model.model.layers[layer].self_attn

    def offset_head(self, layer: int, head: int, offset: int, strength: float = 6.0) -> None:
        """Attend `offset` positions back: the key is pre-rotated on the fastest pairs."""
        attn = self.attention(layer)
        for i in FAST_PAIRS:
            angle = offset * float(self.inverse_frequencies[i])
            attn.q_proj.weight[head * HEAD_SIZE + i, ONE] = strength
            attn.k_proj.weight[head * HEAD_SIZE + i, ONE] = strength * math.cos(angle)
            attn.k_proj.weight[head * HEAD_SIZE + i + HEAD_SIZE // 2, ONE] = strength * math.sin(
                angle
            )

    def copy_token(self, layer: int, head: int, into: slice, gain: float, *, zero_sink: bool):
        """Value = the attended token's code (minus its `<|im_start|>` part with zero_sink)."""
        import torch

        attn = self.attention(layer)
        mix = torch.eye(CODE)
        if zero_sink:
            u = self.code("<|im_start|>") / CODE_NORM
            mix = mix - torch.outer(u, u)
        rows = slice(head * HEAD_SIZE, head * HEAD_SIZE + CODE)
        attn.v_proj.weight[rows, TOK] = mix
        attn.o_proj.weight[into, rows] = gain * torch.eye(CODE)

    def copy_scalar(self, layer: int, head: int, read, into: int, gain: float, slot: int = 0):
        attn = self.attention(layer)
        row = head * HEAD_SIZE + 100 + slot  # value dims 100+ are free in every head
        attn.v_proj.weight[row] = read
        attn.o_proj.weight[into, row] = gain

    def score(self, layer: int, head: int, slot: int, query, key) -> int:
        """Add (query·x_i)(key·x_j) to the head's score on position-free dim `slot`."""
        attn = self.attention(layer)
        row = head * HEAD_SIZE + FREE_DIMS[slot]
        attn.q_proj.weight[row] += query
        attn.k_proj.weight[row] += key
        return slot + 1

    def score_match(self, layer: int, head: int, slot: int, query_space, key_space, size, w):
        """Add w·(x_i[query_space]·x_j[key_space]) over `size` dims."""
        for i in range(size):
            self.score(
                layer,
                head,
                slot + i,
                self.axis(query_space.start + i, w),
                self.axis(key_space.start + i, 1.0),
            )
        return slot + size

    # ------------------------------------------------------------------ MLP pieces
    def unit(self, layer: int, terms, need: float, out, sharpness: float = 60.0) -> None:
        """Writes `out` when the sum of matched terms (each ~its weight) reaches `need`."""
        mlp = self.model.model.layers[layer].mlp
        u = self.units_used[layer]
        self.units_used[layer] += 1
        gate = sum(w * v for v, w in terms) - (need - 0.5) * self.axis(ONE)
        mlp.gate_proj.weight[u] = sharpness * gate
        mlp.up_proj.weight[u, ONE] = 1.0
        mlp.down_proj.weight[:, u] = out / (sharpness * 0.5 * self.mlp_input_scale[layer])

    def ramp(self, layer: int, read, at: float, out, sharpness: float = 2000.0) -> None:
        """Writes `out * max(read - at, 0)`.

        The bias goes through the constant axis, so the break point survives RMSNorm.
        """
        mlp = self.model.model.layers[layer].mlp
        u = self.units_used[layer]
        self.units_used[layer] += 1
        mlp.gate_proj.weight[u] = sharpness * (read - at * self.axis(ONE))
        mlp.up_proj.weight[u, ONE] = 1.0
        mlp.down_proj.weight[:, u] = out / (sharpness * self.mlp_input_scale[layer])

    # ------------------------------------------------------------------ the program
    def _write(self, spec: LabModelSpec) -> None:
        m = self.model
        R, fl = self.reads, self.flag
        embedding_scale = math.sqrt(HIDDEN / (CODE_NORM**2 + 1))  # 1/RMS of an embedding
        m.model.embed_tokens.weight[:, TOK] = self.codes
        m.model.embed_tokens.weight[:, ONE] = 1.0
        m.lm_head.weight[:, OUT] = self.codes
        m.model.norm.weight.fill_(spec.logit_scale)

        # layer 0 attention: what sits 1, 2, 3 and 4 positions back
        for head, offset in enumerate((1, 2, 3, 4)):
            self.offset_head(0, head, offset)
        self.copy_token(0, 0, P1, 1 / embedding_scale, zero_sink=False)
        self.copy_token(0, 1, P2, 1 / embedding_scale, zero_sink=False)
        self.copy_scalar(0, 2, R(TOK, "response"), FLAG["back3_response"], 1 / embedding_scale)
        self.copy_scalar(0, 2, R(TOK, "relation"), FLAG["back3_relation"], 1 / embedding_scale, 1)
        self.copy_scalar(0, 3, R(TOK, "</"), FLAG["back4_close"], 1 / embedding_scale)

        # layer 0 MLP: flags
        def flag_unit(terms, out):
            self.unit(0, terms, len(terms), out)

        flag_unit([(R(TOK, "<|im_start|>"), 1), (R(P1, "<|im_start|>"), 1)], fl("position0"))
        flag_unit([(R(P1, "\n"), 1), (fl("back3_response"), 1)], fl("result_name"))
        flag_unit([(R(P1, " from"), 1), (R(P2, "Start"), 1)], fl("start_name"))
        flag_unit([(R(TOK, ' "'), 1), (R(P2, "entity"), 1)], fl("entity_slot"))
        flag_unit([(R(TOK, ">"), 1), (R(P1, "answer"), 1), (R(P2, "<"), 1)], fl("entity_slot"))
        flag_unit([(R(TOK, ' "'), 1), (R(P2, "relation"), 1)], fl("relation_slot"))
        flag_unit([(R(TOK, "<"), 1), (R(P1, "\n"), 1), (R(P2, "istant"), 1)], fl("turn_open"))
        flag_unit([(R(TOK, "answer"), 1), (R(P1, "<"), 1), (R(P2, "\n"), 1)], fl("answer_open"))
        for digit in range(1, MAX_HORIZON + 1):
            out = fl("numbered_line") + self.axis(LINE.start + digit)
            flag_unit([(R(P1, "."), 1), (R(P2, str(digit)), 1)], out)

        # layer 1 attention: count tool results; is an answer open
        self.score(1, 0, 0, self.axis(ONE, 25.0), fl("result_name") + fl("position0"))
        self.copy_scalar(1, 0, fl("position0"), FLAG["count"], 1.0)
        slot = self.score(1, 1, 0, self.axis(ONE, 40.0), fl("answer_open"))
        self.score(1, 1, slot, self.axis(ONE, 20.0), R(TOK, "<|im_start|>"))
        self.copy_scalar(1, 1, fl("answer_open"), FLAG["in_answer"], 1.0)

        self.write_count_codes([1.15 / (1 + n) for n in range(MAX_COUNT + 1)])

        # layer 2 attention: fetch the entity, the relation, done; continue a name
        u = 40.0
        sink = R(TOK, "<|im_start|>")
        slot = self.score_match(2, 0, 0, ORD, ORD, 12, u)  # same segment
        slot = self.score(2, 0, slot, fl("entity_slot", u), fl("result_name") + fl("start_name"))
        self.score(2, 0, slot, self.axis(ONE, 0.5 * u), sink)
        self.copy_token(2, 0, OUT, 2 * self.gain, zero_sink=True)
        for head, slot_flag in ((1, "relation_slot"), (2, "turn_open")):
            slot = self.score_match(2, head, 0, ORD_NEXT, LINE, 12, u)
            slot = self.score(2, head, slot, fl(slot_flag, u), fl("numbered_line"))
            self.score(2, head, slot, self.axis(ONE, 1.5 * u), sink)
        self.copy_token(2, 1, OUT, 2 * self.gain, zero_sink=True)
        self.copy_scalar(2, 2, sink, FLAG["done"], 1.0)
        for i in range(CODE):  # induction: the key's previous token is the query's token
            self.score(2, 3, i, self.axis(TOK.start + i, u / CODE_NORM**2), self.axis(P1.start + i))
        slot = self.score_match(2, 3, CODE, ORD, ORD, 12, u)
        self.score(2, 3, slot, self.axis(ONE, 0.5 * u), sink)
        self.copy_token(2, 3, OUT, self.gain, zero_sink=True)

        # layer 2 MLP: the grammar of a call and of an answer
        def rule(terms, next_token):
            self.unit(
                2, terms, sum(w for _, w in terms if w > 0), self.emits(next_token, 2 * self.gain)
            )

        rule([(R(TOK, "\n"), 1), (R(P1, "istant"), 1)], "<")
        rule([(fl("turn_open"), 1), (fl("done"), -1)], "tool")
        rule([(fl("turn_open"), 1), (fl("done"), 1)], "answer")
        rule([(R(TOK, "tool"), 1)], "_")
        rule([(R(TOK, "_"), 1), (R(P1, "tool"), 1)], "call")
        rule([(R(TOK, "call"), 1)], ">")
        rule([(R(TOK, ">"), 1), (R(P1, "call"), 1), (fl("back4_close"), -1)], "\n")
        rule([(R(TOK, ">"), 1), (R(P1, "call"), 1), (fl("back4_close"), 1)], "<|im_end|>")
        rule([(R(TOK, "\n"), 1), (R(P1, ">"), 1)], '{"')
        rule([(R(TOK, '{"'), 1)], "name")
        rule([(R(TOK, "name"), 1), (R(P1, '{"'), 1)], '":')
        rule([(R(TOK, '":'), 1), (R(P1, "name"), 1)], ' "')
        rule([(R(TOK, ' "'), 1), (R(P1, '":'), 1), (R(P2, "name"), 1)], "lookup")
        rule([(R(TOK, "lookup"), 1)], '",')
        rule([(R(TOK, '",'), 1)], ' "')
        rule([(R(TOK, ' "'), 1), (R(P1, '",'), 1), (R(P2, "lookup"), 1)], "arguments")
        rule([(R(TOK, ' "'), 1), (R(P1, '",'), 1), (R(P2, "lookup"), -1)], "relation")
        rule([(R(TOK, "arguments"), 1)], '":')
        rule([(R(TOK, '":'), 1), (R(P1, "arguments"), 1)], ' {"')
        rule([(R(TOK, ' {"'), 1)], "entity")
        rule([(R(TOK, "entity"), 1), (R(P1, ' {"'), 1)], '":')
        rule([(R(TOK, '":'), 1), (R(P1, "entity"), 1)], ' "')
        rule([(R(TOK, "relation"), 1), (R(P1, ' "'), 1)], '":')
        rule([(R(TOK, '":'), 1), (R(P1, "relation"), 1)], ' "')
        for relation in RELATION_TOKENS:
            rule([(R(TOK, relation), 1), (fl("back3_relation"), 1)], '"')
        rule([(R(TOK, " twin"), 1), (fl("back3_relation"), 1)], "_")
        rule([(R(TOK, "_"), 1), (R(P1, " twin"), 1)], "city")
        rule([(R(TOK, "city"), 1), (R(P1, "_"), 1)], '"')
        rule([(R(TOK, '"'), 1)], "}}")
        rule([(R(TOK, "}}"), 1)], "\n")
        rule([(R(TOK, "\n"), 1), (R(P1, "}}"), 1)], "</")
        rule([(R(TOK, "</"), 1), (R(P1, "\n"), 1), (fl("in_answer"), -1)], "tool")
        rule([(R(TOK, "</"), 1), (fl("in_answer"), 1)], "answer")
        rule([(R(TOK, "answer"), 1), (R(P1, "<"), 1)], ">")
        rule([(R(TOK, "answer"), 1), (R(P1, "</"), 1)], ">")
        rule([(R(TOK, ">"), 1), (R(P1, "answer"), 1), (R(P2, "</"), 1)], "<|im_end|>")
        # the end of a copied name: its source is followed by a line break or " ("
        not_a_name = [
            (fl("back3_relation"), -1),
            (fl("entity_slot"), -1),
            (fl("relation_slot"), -1),
            (R(TOK, "city"), -1),
        ]
        copied = 1.0 / self.gain  # OUT holds gain * code where the induction head copied
        for end in ("\n", " ("):
            self.unit(
                2,
                [(R(OUT, end), copied), (fl("in_answer"), -1), *not_a_name],
                1.1,
                self.emits('",', 3 * self.gain),
            )
        self.unit(
            2,
            [(R(OUT, "\n"), copied), (fl("in_answer"), 1), *not_a_name],
            2.1,
            self.emits("</", 3 * self.gain),
        )

    def write_count_codes(self, levels: list[float]) -> None:
        """Layer 1 MLP: the count head's output -> one-hot codes of n and n + 1.

        Piecewise linear between `levels`, the head's outputs after 0, 1, ... tool results.
        """
        import torch

        mlp = self.model.model.layers[1].mlp
        with torch.no_grad():
            for proj in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                proj.weight.zero_()
            self.units_used[1] = 0
            levels = [*levels, 2 * levels[-1] - levels[-2]]
            for space, shift in ((ORD, 0), (ORD_NEXT, 1)):

                def one_hot(n, space=space, shift=shift):
                    v = torch.zeros(HIDDEN)
                    if n <= MAX_COUNT and n + shift < space.stop - space.start:
                        v[space.start + n + shift] = 1.0
                    return v

                previous_slope = torch.zeros(HIDDEN)
                for n in range(len(levels) - 1, 0, -1):  # ascending levels: n = last ... 1
                    low, high = levels[n], levels[n - 1]
                    slope = (one_hot(n - 1) - one_hot(n)) / (high - low)
                    self.ramp(1, self.flag("count"), low, slope - previous_slope)
                    previous_slope = slope

    def measure_count_levels(self, tokenizer) -> list[float]:
        """The count head's output after 0, 1, ... tool results, from a synthetic episode."""
        import torch

        turns = "".join(
            f"<|im_start|>tool\n<tool_response>\nName{i}\n</tool_response><|im_end|>\n"
            for i in range(MAX_HORIZON)
        )
        ids = tokenizer.encode(
            "<|im_start|>system\nx<|im_end|>\n" + turns, add_special_tokens=False
        )
        with torch.no_grad():
            states = self.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        count = states.hidden_states[2][0, :, FLAG["count"]]
        response, newline = self.ids["response"], self.ids["\n"]
        starts = [i for i in range(3, len(ids)) if ids[i - 1] == newline and ids[i - 3] == response]
        levels = [float(count[1])] + [float(count[p]) for p in starts]
        # beyond the measured counts, 1/level grows linearly (n results + a position-0 weight)
        step = 1 / levels[-1] - 1 / levels[-2]
        while len(levels) < MAX_COUNT + 1:
            levels.append(1 / (1 / levels[-1] + step))
        return levels
