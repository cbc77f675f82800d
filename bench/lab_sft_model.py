"""A lab model with slack: a small Llama trained by SFT on MultiHop's oracle episodes (issue 31).

The builder of the trained lab model shipped in tir_rl/data/lab_sft (`model: lab-sft`):
scripts/build_lab_sft.sh runs it twice, once from random weights and once with `--init` and
`--early-answer-rate 0.1`. What one call does:

1. A tokenizer of its own, built with `tokenizers`: byte-level BPE (600 merges' worth)
   learned from rendered oracle episodes, the chat format's special tokens, and every entity
   name of both splits and every relation name as one added token each. Episodes render and
   decode exactly as with the bundled tokenizer; the chat template is the bundled one.
2. A Llama (hidden 128, 4 layers, 2 heads of 64, tied embedding) from random weights, with
   two things set at the start:
   - the embedding holds fixed-norm random codes (norm = sqrt(hidden)); every name's code
     shares one direction, every relation's another, so a name the SFT never saw (the test
     split's names) still reads as a name. The embedding is frozen during SFT only.
   - in layers 0, 1 and 3, head 0's value and output projections are one orthonormal
     projection (V = Q^T, O = Q): a path that can copy a token's code, at gain 1. Queries
     and keys are random: where to look is learned.
3. SFT on oracle episodes of the train split (horizons 1-8), the loss on the assistant's
   tokens, names and relations weighted 10x, AdamW with warm-up and cosine decay.
   With `--early-answer-rate R`, each demonstration stops at each hop before the last with
   probability R and answers with the entity reached so far (a wrong answer); with `--init`,
   steps 1-2 are replaced by an earlier build's tokenizer and weights.

    python bench/lab_sft_model.py --out /tmp/lab-sft --steps 1000   # ~10 min on 2 cores

It prints one JSON line per evaluation (teacher-forced, greedy, on 64 horizon-4 tasks of
the test split: token accuracy, name and relation accuracy, whole turns right) and saves the
model and tokenizer in --out, which `tir-rl eval --checkpoint` and `model:` accept.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

NAME_WEIGHT_DEFAULT = 10.0


TEST_SPLIT_SFT_OFFSET = 5 * 10**6
"""First test-split task index of the demonstrations (`--splits test`): the evaluations draw
indices 0..N-1 (`tir-rl eval`, a run's held-out tasks) and the builder's own 10**6.. ."""


def entity_names() -> list[str]:
    """Every first x last combination of MultiHop's name pools, both splits, in pool order.

    This includes combinations no split draws (a train first name with a test surname): a
    few hundred unused tokens, kept so that the recorded builds stay reproducible.
    """
    import tir_rl.envs.knowledge_base as kb

    return (
        [f"{a} {b}" for a in kb._FIRST for b in kb._LAST]
        + [f"{a} {b}" for a in kb._COMPANY for b in kb._COMPANY_SUFFIX]
        + [f"{a} {b}" for a in kb._CITY_PREFIX for b in kb._CITY]
    )


def relation_names() -> list[str]:
    from tir_rl.envs.knowledge_base import RELATIONS

    return sorted({r for rs in RELATIONS.values() for r in rs})


def build_tokenizer(out: Path):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    import tir_rl.envs.multihop as mh
    from tir_rl.lab.sft import play_demonstration
    from tir_rl.models import resolve_model

    bundled = AutoTokenizer.from_pretrained(resolve_model("lab"))
    corpus = []
    for horizon in range(1, 10):
        env = mh.MultiHopEnv(horizon=horizon, split="train")
        corpus += [
            bundled.decode(play_demonstration(env, bundled, seed=s).token_ids) for s in range(3)
        ]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
    )
    tokenizer.train_from_iterator(corpus * 5, trainer)
    tokenizer.add_tokens(
        [AddedToken(n, normalized=False) for n in entity_names() + relation_names()]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        bos_token="<|im_start|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    hf.chat_template = bundled.chat_template
    hf.save_pretrained(out)
    return hf


def main() -> None:
    import torch
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    import tir_rl.envs.multihop as mh
    from tir_rl.lab.sft import play_turns, shared_prefix_length
    from tir_rl.types import Message

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--seed", type=int, default=0, help="weights, codes, batches and demonstrations"
    )
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=8, help="episodes per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--name-weight", type=float, default=NAME_WEIGHT_DEFAULT)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--copy-layers", default="0,1,3", help="'' for none")
    parser.add_argument(
        "--horizons",
        type=int,
        nargs="+",
        default=[1, 2, 2, 3, 3, 4, 4, 5, 6, 8],
        help="horizons of the training episodes, cycled",
    )
    parser.add_argument("--episodes", type=int, default=4000, help="training demonstrations")
    parser.add_argument(
        "--splits",
        nargs="+",
        default=["train"],
        choices=["train", "test"],
        help="MultiHop splits the demonstrations' tasks come from, in equal parts; test-split "
        f"tasks from index {TEST_SPLIT_SFT_OFFSET:,} on, which no evaluation draws",
    )
    parser.add_argument(
        "--early-answer-rate",
        type=float,
        default=0.0,
        help="chance, at each hop before the last, that a demonstration stops and answers "
        "with the entity reached so far (a wrong answer): a habit RL can unlearn",
    )
    parser.add_argument(
        "--init",
        type=Path,
        help="start from this build's weights and tokenizer (instead of random weights and a "
        "new tokenizer; --copy-layers then does nothing); the embedding stays frozen",
    )
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.init:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(args.init)
        hf.save_pretrained(args.out)
    else:
        hf = build_tokenizer(args.out)
    vocab = len(hf)
    names = torch.tensor(sorted(hf.convert_tokens_to_ids(entity_names())))
    relations = torch.tensor(sorted(hf.convert_tokens_to_ids(relation_names())))

    def turns_for(env, task, rate: float, seed: int) -> list[Message]:
        turns = env.demonstration(task)
        draw = random.Random(f"early-answer/{task.id}/{seed}")
        for hop, entity in enumerate(task.data["path"][:-1]):
            if draw.random() < rate:
                return [*turns[:hop], Message.assistant(f"<answer>{entity}</answer>")]
        return turns

    def demos(split: str, n: int, horizons: list[int], seed0: int, rate: float = 0.0):
        envs = {h: mh.MultiHopEnv(horizon=h, split=split) for h in horizons}
        return [
            play_turns(
                (env := envs[horizons[i % len(horizons)]]),
                hf,
                lambda task, env=env, s=seed0 + i: turns_for(env, task, rate, s),
                seed=seed0 + i,
            )
            for i in range(n)
        ]

    train = []
    for split in args.splits:
        first = args.seed * 10**7 + (TEST_SPLIT_SFT_OFFSET if split == "test" else 0)
        train += demos(
            split, args.episodes // len(args.splits), args.horizons, first, args.early_answer_rate
        )
    test = demos("test", 64, [4], 10**6)

    d = args.hidden
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=4 * d,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=hf.bos_token_id,
        eos_token_id=hf.eos_token_id,
        pad_token_id=hf.pad_token_id,
    )
    model = LlamaForCausalLM.from_pretrained(args.init) if args.init else LlamaForCausalLM(config)
    shape = {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads"}
    for arg, key in shape.items():
        if args.init and getattr(model.config, key) != getattr(args, arg):
            raise SystemExit(
                f"--{arg} {getattr(args, arg)}: the --init build has {getattr(model.config, key)}"
                f": give --{arg} {getattr(model.config, key)}"
            )
    if not args.init:
        with torch.no_grad():
            codes = torch.randn(vocab, d)
            codes /= codes.norm(dim=1, keepdim=True)
            for ids in (names, relations):
                shared = torch.randn(d)
                codes[ids] += shared / shared.norm()
            codes /= codes.norm(dim=1, keepdim=True)
            model.model.embed_tokens.weight.copy_(codes * math.sqrt(d))
            model.model.norm.weight.fill_(0.1)
            head_dim = d // args.heads
            for layer in [int(x) for x in args.copy_layers.split(",") if x]:
                attention = model.model.layers[layer].self_attn
                q, _ = torch.linalg.qr(torch.randn(d, head_dim))
                attention.v_proj.weight[:head_dim] = q.T
                attention.o_proj.weight[:, :head_dim] = q
    model.model.embed_tokens.weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.98)
    )
    prefix_len = shared_prefix_length(train + test)
    prefix = torch.tensor([train[0].token_ids[:prefix_len]])

    def batch(episodes):
        n = max(len(x.token_ids) for x in episodes) - prefix_len
        ids = torch.full((len(episodes), n), hf.pad_token_id)
        labels = torch.full((len(episodes), n), -100)
        mask = torch.zeros((len(episodes), prefix_len + n), dtype=torch.long)
        mask[:, :prefix_len] = 1
        for i, x in enumerate(episodes):
            tokens = torch.tensor(x.token_ids[prefix_len:])
            loss_mask = torch.tensor(x.loss_mask[prefix_len:], dtype=torch.bool)
            ids[i, : len(tokens)] = tokens
            mask[i, prefix_len : prefix_len + len(tokens)] = 1
            labels[i, : len(tokens)] = torch.where(loss_mask, tokens, -100)
        return ids, mask, labels

    def logits_of(ids, mask):
        # The shared system turn once, without gradient; the rest batched on its cache.
        with torch.no_grad():
            cache = model.model(input_ids=prefix, use_cache=True).past_key_values
        b = ids.shape[0]
        kv = [
            (layer.keys.expand(b, -1, -1, -1), layer.values.expand(b, -1, -1, -1))
            for layer in cache.layers
        ]
        positions = torch.arange(prefix_len, prefix_len + ids.shape[1]).unsqueeze(0).expand(b, -1)
        hidden = model.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=DynamicCache(ddp_cache_data=kv),
            use_cache=True,
        ).last_hidden_state
        return model.lm_head(hidden)[:, :-1]

    def evaluate() -> dict[str, float]:
        model.eval()
        counts = {"token": [0, 0], "name": [0, 0], "relation": [0, 0], "turn": [0, 0]}
        with torch.no_grad():
            for i in range(0, len(test), 16):
                ids, mask, labels = batch(test[i : i + 16])
                target = labels[:, 1:]
                scored = target != -100
                right = logits_of(ids, mask).argmax(-1) == target
                for key, where in (
                    ("token", scored),
                    ("name", torch.isin(target, names)),
                    ("relation", torch.isin(target, relations)),
                ):
                    counts[key][0] += (right & where).sum().item()
                    counts[key][1] += where.sum().item()
                for row in range(ids.shape[0]):
                    in_turn, turn_right = False, True
                    for j, s in enumerate(scored[row].tolist() + [False]):
                        if s:
                            turn_right = (
                                turn_right and bool(right[row, j])
                                if in_turn
                                else bool(right[row, j])
                            )
                            in_turn = True
                        elif in_turn:
                            counts["turn"][0] += turn_right
                            counts["turn"][1] += 1
                            in_turn = False
        model.train()
        return {k: round(a / max(n, 1), 3) for k, (a, n) in counts.items()}

    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        lr = args.lr * min(1.0, step / 100) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids, mask, labels = batch(rng.sample(train, args.batch))
        target = labels[:, 1:].reshape(-1)
        per_token = torch.nn.functional.cross_entropy(
            logits_of(ids, mask).reshape(-1, vocab), target, ignore_index=-100, reduction="none"
        )
        hard = torch.isin(target, names) | torch.isin(target, relations)
        weight = (target != -100).float() * (1 + (args.name_weight - 1) * hard.float())
        loss = (per_token * weight).sum() / (target != -100).sum()
        optimizer.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if step % args.eval_every == 0 or step == args.steps:
            row = {
                "step": step,
                "loss": round(loss.item(), 4),
                "grad_norm": round(grad_norm.item(), 2),
            }
            row |= evaluate()
            row["s"] = round(time.perf_counter() - started)
            print(json.dumps(row), flush=True)
    model.save_pretrained(args.out)
    print(
        json.dumps(
            {
                "saved": str(args.out),
                "parameters": sum(p.numel() for p in model.parameters()),
                "vocab": vocab,
                "prefix_tokens": prefix_len,
                "demonstrations": len(train),
                "early_answers": sum(d.reward < 1.0 for d in train),
                "args": {k: str(v) for k, v in vars(args).items()},
            }
        )
    )


if __name__ == "__main__":
    main()
