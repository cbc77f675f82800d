"""Can vLLM's own multi-turn sessions close the agent loop's gap to single-turn requests?

`bench/agent_loop.py` measures tir-rl's loop at 0.76 of the single-turn rate on the bundled
model (issue 47 asks for 0.90). Each of its turns is a new request that re-sends the episode's
context; the prefix cache supplies most of it, but the tail of a turn shorter than one KV block
(32 tokens on a CPU) is computed again, and so are the tool's tokens. vLLM 0.32 has a means
of its own for multi-turn work: *streaming input* (`AsyncLLM.generate` given an async
generator of `StreamingInput`), a request that stays resident between turns with its KV
blocks held, to which each new chunk of prompt tokens is appended. This script measures,
straight on `AsyncLLM` (no tir-rl code in the loop, so only the engine's side is compared), in
one run with the modes interleaved and the best of `--repeats` kept:

  (a)  plain:    B single-turn requests of K*T tokens
  (b)  re-sent:  B episodes of K turns of T tokens, each turn a new request carrying the whole
                 context, then the tool's reply (what tir-rl does; prefix cache on, 32-token blocks)
  (s)  session:  the same episodes as one streaming-input request each; each new chunk is the
                 last sampled token (vLLM leaves it uncomputed) and the tool's reply
  (b0), (s0):    (b) and (s) with no tool reply: the episode's own tokens only

Every request ignores end-of-sequence so that every mode samples exactly B*K*T tokens. The
second table counts the tokens the engine computed besides the sampled ones (prompt tokens the
prefix cache did not supply): what separates the multi-turn modes from (a).

    python bench/engine_sessions.py                  # bundled SmolLM2-135M, 32 x 4 x 32
    python bench/engine_sessions.py --report         # the kept records

Kept records: bench/engine_sessions_records/ (docs/performance.md quotes them).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

RECORDS = Path(__file__).resolve().parent / "engine_sessions_records"
TOOL_REPLY = "<|im_end|>\n<|im_start|>user\nok, go on<|im_end|>\n<|im_start|>assistant\n"
"""What each turn's tool answers, in the bundled model's ChatML (the end of the assistant's
turn included, since every turn is cut at T tokens)."""


@dataclass
class Measured:
    sampled: int
    computed_prompt: int
    """Prompt tokens the engine computed (not from the prefix cache)."""
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.sampled / self.seconds


def sampling(max_tokens: int):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        temperature=1.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        logprobs=0,
        output_kind=RequestOutputKind.DELTA,
    )


async def timed(episodes: list[Awaitable[tuple[int, int]]]) -> Measured:
    t0 = time.perf_counter()
    counts = await asyncio.gather(*episodes)
    seconds = time.perf_counter() - t0
    return Measured(sum(c[0] for c in counts), sum(c[1] for c in counts), seconds)


async def plain_request(llm, prompt: list[int], tokens: int, request_id: str) -> tuple[int, int]:
    from vllm.inputs import TokensPrompt

    sampled, computed = 0, 0
    request = TokensPrompt(prompt_token_ids=prompt)
    async for out in llm.generate(request, sampling(tokens), request_id):
        sampled += len(out.outputs[0].token_ids)
        computed = len(prompt) - (out.num_cached_tokens or 0)
    return sampled, computed


async def resent_episode(
    llm, prompt: list[int], tool: list[int], turns: int, tokens: int, request_id: str
) -> tuple[int, int]:
    """Each turn a new request with the whole context so far."""
    from vllm.inputs import TokensPrompt

    context, sampled, computed = list(prompt), 0, 0
    for turn in range(turns):
        got: list[int] = []
        cached = 0
        request = TokensPrompt(prompt_token_ids=context)
        async for out in llm.generate(request, sampling(tokens), f"{request_id}-{turn}"):
            got += out.outputs[0].token_ids
            cached = out.num_cached_tokens or 0
        sampled += len(got)
        computed += len(context) - cached
        context += got + tool
    return sampled, computed


async def session_episode(
    llm, prompt: list[int], tool: list[int], turns: int, tokens: int, request_id: str
) -> tuple[int, int]:
    """One streaming-input request for the whole episode."""
    from vllm.engine.protocol import StreamingInput
    from vllm.inputs import TokensPrompt

    chunks: asyncio.Queue[list[int] | None] = asyncio.Queue()

    async def inputs() -> AsyncIterator[StreamingInput]:
        while (chunk := await chunks.get()) is not None:
            yield StreamingInput(prompt=TokensPrompt(prompt_token_ids=chunk))

    chunks.put_nowait(list(prompt))
    sampled, computed, turn, cached = 0, len(prompt), 0, None
    got: list[int] = []
    async for out in llm.generate(inputs(), sampling(tokens), request_id):
        if cached is None:
            cached = out.num_cached_tokens or 0
        got += out.outputs[0].token_ids
        if out.outputs[0].finish_reason is None:
            continue
        sampled += len(got)
        turn += 1
        if turn == turns:
            chunks.put_nowait(None)
        else:
            chunk = [got[-1], *tool]  # vLLM drops the last sampled token's (uncomputed) slot
            computed += len(chunk)
            chunks.put_nowait(chunk)
        got = []
    return sampled, computed - (cached or 0)


def report(records: Path = RECORDS) -> str:
    """The kept records, as printed."""
    paths = sorted(records.glob("*.txt"))
    return "\n\n".join(f"{path.name}:\n{path.read_text()}" for path in paths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bundled", help="bundled | tiny | lab-sft | folder")
    parser.add_argument("--episodes", type=int, default=32, help="B: episodes in flight")
    parser.add_argument("--turns", type=int, default=4, help="K: turns per episode")
    parser.add_argument("--tokens-per-turn", type=int, default=32, help="T")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs; best kept")
    parser.add_argument("--report", action="store_true", help="print the kept records")
    args = parser.parse_args()
    if args.report:
        print(report())
        return
    asyncio.run(measure(args))


async def measure(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from tir_rl.engine.cpu_platform import CPU_PREFIX_CACHE_BLOCK_SIZE
    from tir_rl.models import resolve_model

    path = str(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(path)
    story = "Write a long story about a lighthouse keeper, one paragraph at a time."
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": story},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text)
    tool = tokenizer.encode(TOOL_REPLY)
    b, k, t = args.episodes, args.turns, args.tokens_per_turn
    llm = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=path,
            dtype="float32",
            max_model_len=2048,
            enforce_eager=True,
            seed=0,
            enable_prefix_caching=True,
            block_size=CPU_PREFIX_CACHE_BLOCK_SIZE,
            kv_cache_memory_bytes=1 << 30,
            max_num_seqs=max(64, b),
            disable_log_stats=True,
        )
    )
    modes: dict[str, Callable[[str], Awaitable[Measured]]] = {
        "(a) plain requests": lambda tag: timed(
            [plain_request(llm, prompt, k * t, f"{tag}-{i}") for i in range(b)]
        ),
        "(b) re-sent context + tool reply": lambda tag: timed(
            [resent_episode(llm, prompt, tool, k, t, f"{tag}-{i}") for i in range(b)]
        ),
        "(s) session + tool reply": lambda tag: timed(
            [session_episode(llm, prompt, tool, k, t, f"{tag}-{i}") for i in range(b)]
        ),
        "(b0) re-sent context, no reply": lambda tag: timed(
            [resent_episode(llm, prompt, [], k, t, f"{tag}-{i}") for i in range(b)]
        ),
        "(s0) session, no reply": lambda tag: timed(
            [session_episode(llm, prompt, [], k, t, f"{tag}-{i}") for i in range(b)]
        ),
    }
    try:
        for n, run in enumerate(modes.values()):  # warm-up: first-request paths out of the way
            await run(f"warm{n}")
        best: dict[str, Measured] = {}
        for repeat in range(args.repeats):
            for n, (name, run) in enumerate(modes.items()):
                await llm.reset_prefix_cache()  # every mode starts from the same empty cache
                measured = await run(f"r{repeat}m{n}")
                if name not in best or measured.tokens_per_s > best[name].tokens_per_s:
                    best[name] = measured
    finally:
        llm.shutdown()

    print(
        f"model {Path(path).name} (fp32), {b} episodes in flight, {k} turns x {t} tokens "
        f"(end of sequence ignored), prefix cache on, KV block {CPU_PREFIX_CACHE_BLOCK_SIZE}, "
        f"best of {args.repeats}"
    )
    print(f"{'mode':<34} {'sampled':>8} {'computed prompt':>16} {'seconds':>8} {'tokens/s':>9}")
    for name, m in best.items():
        print(
            f"{name:<34} {m.sampled:>8} {m.computed_prompt:>16} {m.seconds:>8.2f} "
            f"{m.tokens_per_s:>9.1f}"
        )
    plain = best["(a) plain requests"].tokens_per_s
    print(f"\n{'ratio to (a) plain tokens/s':<34} {'value':>8}")
    for name, m in list(best.items())[1:]:
        print(f"{name.split(')')[0] + ')':<34} {m.tokens_per_s / plain:>8.3f}")


if __name__ == "__main__":
    main()
