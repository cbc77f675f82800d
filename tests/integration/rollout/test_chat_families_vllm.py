"""The qwen and llama3 chat formats in tool-using episodes on real vLLM (CPU, tiny model).

Each family gets a tokenizer built from the bundled one (`tests/unit/chat_tokenizers.py`)
and the shared tiny random Llama with its embeddings resized to cover the added tokens;
one engine per family, started once for the module's tests of that family.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from rollout_helpers import RecordingEngine

from tir_rl.chat import ChatFormatName, compare_incremental_with_full
from tir_rl.envs.base import Task, ToolEnv
from tir_rl.models import prepare_tiny_model
from tir_rl.rollout import Rollout, group_specs
from tir_rl.rollout.episode import turn_seed
from tir_rl.tools import ToolRegistry, tool
from tir_rl.types import Message, RolloutStatus

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit"))
from chat_tokenizers import llama3_tokenizer, qwen_tokenizer  # noqa: E402

pytestmark = pytest.mark.vllm

NUM_TOOL_TURNS = 3
RESULTS = ("5", "8 <|im_end|> <|eot_id|> </tool_response>")  # special-looking text stays text


class FakeAlwaysCalledEnv(ToolEnv):
    """Has an `add` tool; answers every turn with two tool results, ends after N turns."""

    def build_tools(self) -> ToolRegistry:
        @tool
        def add(a: int, b: int) -> int:
            """Add two integers.

            Args:
                a: first
                b: second
            """
            return a + b

        return ToolRegistry([add])

    def generate_task(self, index: int) -> Task:
        return Task(f"sum/{index}", "What is 2+3 and 4+4?", "5, 8", self.split, 1)

    def instructions(self, task: Task) -> str:
        return "You are a calculator."

    def score(self, task: Task, answer: str) -> float:
        return 0.0

    def reset(self, *, seed=None, options=None):
        self.num_turns = 0
        return super().reset(seed=seed, options=options)

    def step(self, action: Message):
        self.num_turns += 1
        if self.num_turns > NUM_TOOL_TURNS:
            return [], 1.0, True, False, {}
        return [Message.tool(r, name="add") for r in RESULTS], 0.0, False, False, {}


def tiny_model_for(tokenizer, dest: Path) -> Path:
    """The shared tiny random Llama, embeddings resized to the tokenizer's added tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(prepare_tiny_model(), dtype="float32")
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.config.bos_token_id = tokenizer.bos_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)
    return dest


@pytest.fixture(scope="module", params=["qwen", "llama3"])
def family_rollout(request, tmp_path_factory):
    """(family, tokenizer, recorder, rollout, specs, trajectories): one engine per family."""
    from transformers import AutoTokenizer

    from tir_rl.engine import VLLMLocalEngine

    family = request.param
    built = qwen_tokenizer() if family == "qwen" else llama3_tokenizer()
    path = tiny_model_for(built, tmp_path_factory.mktemp(f"tiny-{family}"))
    tokenizer = AutoTokenizer.from_pretrained(path)  # as a run loads it
    config = VLLMLocalEngine.Config(
        model_path=str(path),
        max_model_len=2048,
        kv_cache_gib=0.125,
        enable_prefix_caching=False,
        max_num_seqs=8,
    )
    with VLLMLocalEngine(config) as engine:
        recorder = RecordingEngine(engine)
        rollout_config = Rollout.Config(
            max_turns=NUM_TOOL_TURNS + 1,
            max_tokens_per_turn=12,
            end_on_truncated_turn=False,
            temperature=1.0,
            seed=11,
        )
        rollout = Rollout(recorder, tokenizer, rollout_config)
        specs = group_specs(FakeAlwaysCalledEnv, 0, group_size=4, group_id=2)
        yield family, tokenizer, recorder, rollout, specs, rollout.run_batch_sync(specs)


def segments(traj) -> list[tuple[int, int, int]]:
    """(mask, start, end) of each maximal run of equal loss-mask values."""
    runs, start = [], 0
    mask = traj.loss_mask
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


def test_sampled_tokens_are_kept_and_env_tokens_are_the_formats_render(family_rollout):
    family, tokenizer, recorder, rollout, specs, trajs = family_rollout
    env = FakeAlwaysCalledEnv()
    messages, info = env.reset(seed=0)
    fmt = rollout.chat_format_for(env.tools.json_schemas)
    assert fmt.name is ChatFormatName(family)  # chosen by auto-detection
    tool_messages = [Message.tool(r, name="add") for r in RESULTS]
    for spec, traj in zip(specs, trajs, strict=True):
        assert traj.status == RolloutStatus.FINISHED, traj.error
        assert traj.prompt_ids == fmt.render_prompt(messages)
        runs = segments(traj)
        assert [m for m, _, _ in runs] == [1, 0] * NUM_TOOL_TURNS + [1]
        full = traj.prompt_ids + traj.completion_ids
        for k, (mask, start, end) in enumerate(runs):
            ids = traj.completion_ids[start:end]
            if mask == 1:  # exactly what the engine sampled for this prompt
                prompt = tuple(full[: len(traj.prompt_ids) + start])
                result = recorder.calls[(prompt, turn_seed(rollout.config.seed, spec, k // 2))]
                assert ids == result.token_ids
                assert traj.sampler_logprobs[start:end] == result.logprobs
            else:  # exactly the format's rendering of the tool results
                closed = traj.completion_ids[start - 1] == fmt.end_of_turn_id
                assert ids == fmt.render_env_turns(tool_messages, close_turn=not closed)
                assert traj.completion_ids[start:end].count(fmt.end_of_turn_id) == (
                    2 if family == "llama3" else 1
                ) + (not closed)
        text = fmt.decode(full)
        role = (
            "<|start_header_id|>ipython<|end_header_id|>"
            if family == "llama3"
            else ("<|im_start|>user\n<tool_response>")
        )
        assert text.count(role) == NUM_TOOL_TURNS * (2 if family == "llama3" else 1)
    assert len({tuple(t.completion_ids) for t in trajs}) == len(trajs)  # distinct samples


def _promised(fmt, body: list[int]) -> bool:
    """Whether the format promises incremental == full for this sampled turn body."""
    text = fmt.decode(body)
    canonical = fmt.encode_assistant_text(text) == body
    leading = text[:1].isspace() and not (text[:1] == " " and not text[1:2].isspace())
    return canonical and not leading


def test_the_final_token_list_equals_a_full_render_where_the_format_promises_it(family_rollout):
    family, tokenizer, recorder, rollout, specs, trajs = family_rollout
    env = FakeAlwaysCalledEnv()
    messages, _ = env.reset(seed=0)
    fmt = rollout.chat_format_for(env.tools.json_schemas)
    stops = set(fmt.stop_token_ids)
    tool_messages = [Message.tool(r, name="add") for r in RESULTS]

    def rebuild(turns: list[list[int]], *, canonical: bool):
        conv = fmt.conversation(messages)
        for k, ids in enumerate(turns):
            if canonical:  # the tokenizer's own ids of the sampled text
                stop = ids[-1:] if ids and ids[-1] in stops else []
                body = ids[: len(ids) - len(stop)]
                ids = fmt.encode_assistant_text(fmt.decode(body)) + stop
            conv.append_sampled(ids, [0.0] * len(ids))
            if k < len(turns) - 1:
                conv.append_messages(tool_messages)
        return conv

    def bodies(conv) -> list[list[int]]:
        traj = conv.to_trajectory()
        return [
            [t for t in traj.completion_ids[start:end] if t not in stops]
            for mask, start, end in segments(traj)
            if mask == 1
        ]

    num_checked = 0
    for traj in trajs:
        turns = [traj.completion_ids[s:e] for mask, s, e in segments(traj) if mask == 1]
        real = rebuild(turns, canonical=False)
        assert real.token_ids == traj.prompt_ids + traj.completion_ids
        # the format promises incremental == full for canonical turns that do not start
        # with whitespace (docs/chat-format.md): check it on the re-tokenized episode, and
        # on the sampled one itself when its turns are such
        canon = rebuild(turns, canonical=True)
        if all(_promised(fmt, body) for body in bodies(canon)):
            diff = compare_incremental_with_full(canon)
            assert diff.equal, diff.describe()
            num_checked += 1
        if all(_promised(fmt, body) for body in bodies(real)):
            diff = compare_incremental_with_full(real)
            assert diff.equal, diff.describe()
    assert num_checked >= 2, f"only {num_checked} of {len(trajs)} episodes could be checked"
