"""Agent loop with a scripted FakeEngine and a FakeToolEnv (real chat format and tokenizer)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from rollout_fakes import (
    ANSWER,
    UNICODE_TEXT,
    EventLog,
    FakeEngine,
    FakeToolEnv,
    Reply,
    call,
    max_active,
)
from transformers import AutoTokenizer

from tir_rl.chat import ChatFormat
from tir_rl.errors import ConfigError, EngineError
from tir_rl.models import prepare_bundled_model
from tir_rl.rollout import EpisodeSpec, Rollout, group_specs
from tir_rl.types import Message, Role, RolloutStatus


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(prepare_bundled_model())


def specs(num: int, *, make=FakeToolEnv, **env_kwargs) -> list[EpisodeSpec]:
    return [
        EpisodeSpec(
            env_factory=lambda: make(**env_kwargs),
            options={"task_index": k},
            group_id=k,
        )
        for k in range(num)
    ]


def run(engine, tokenizer, num=1, *, env_kwargs=None, **config) -> list:
    rollout = Rollout(engine, tokenizer, Rollout.Config(**config))
    return rollout.run_batch_sync(specs(num, **(env_kwargs or {})))


def model_segments(traj) -> list[list[int]]:
    """Maximal runs of mask-1 tokens, in order."""
    runs: list[list[int]] = []
    previous = 0
    for token, mask in zip(traj.completion_ids, traj.loss_mask, strict=True):
        if mask and not previous:
            runs.append([])
        if mask:
            runs[-1].append(token)
        previous = mask
    return runs


# --------------------------------------------------------------------------- token layout
def test_trajectory_holds_sampled_ids_verbatim_and_rendered_tool_turns_with_mask_zero(tokenizer):
    script = {0: call("echo", text=UNICODE_TEXT), 1: ANSWER}
    engine = FakeEngine(tokenizer, lambda ep, turn: script[turn])
    (traj,) = run(engine, tokenizer)

    assert traj.status == RolloutStatus.FINISHED, traj.error
    assert traj.reward == 1.0
    assert (traj.num_tool_calls, traj.num_tool_errors) == (1, 0)
    first, second = engine.results[(0, 0)], engine.results[(0, 1)]
    env = FakeToolEnv()
    fmt = ChatFormat(tokenizer, tool_schemas=env.tools.json_schemas)
    tool_turn = fmt.render_env_turns([Message.tool(UNICODE_TEXT, name="echo")], close_turn=False)
    expected = first.token_ids + tool_turn + second.token_ids
    assert traj.completion_ids == expected
    assert traj.loss_mask == [1] * len(first.token_ids) + [0] * len(tool_turn) + [1] * len(
        second.token_ids
    )
    zeros = [0.0] * len(tool_turn)
    assert traj.sampler_logprobs == first.logprobs + zeros + second.logprobs
    assert traj.turn_ids == [0] * (len(first.token_ids) + len(tool_turn)) + [1] * len(
        second.token_ids
    )
    # the prompt is the env's reset messages with the tool schemas in the system turn
    messages, _ = env.reset(options={"task_index": 0})
    assert traj.prompt_ids == fmt.render_prompt(messages)
    # each request continued exactly the token list so far
    (_, _, req0), (_, _, req1) = engine.requests
    assert list(req0.prompt_token_ids) == traj.prompt_ids
    assert list(req1.prompt_token_ids) == traj.prompt_ids + first.token_ids + tool_turn
    assert [m.role for m in traj.messages] == [
        Role.SYSTEM, Role.USER, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT,
    ]  # fmt: skip
    assert traj.messages[3].content == UNICODE_TEXT
    assert traj.timings.total_s >= traj.timings.generate_s > 0


def test_requests_carry_stop_ids_sampling_settings_and_distinct_reproducible_seeds(tokenizer):
    engine = FakeEngine(tokenizer, lambda ep, turn: call("echo", text="x") if turn < 2 else ANSWER)
    config = Rollout.Config(temperature=0.7, seed=3, top_p=0.9, top_k=20, min_p=0.05)
    rollout = Rollout(engine, tokenizer, config)
    rollout.run_batch_sync(group_specs(FakeToolEnv, None, group_size=2, options={"task_index": 0}))
    requests = [r for _, _, r in engine.requests]
    assert len(requests) == 6
    assert all(r.temperature == 0.7 for r in requests)
    assert all(r.truncation == config.truncation for r in requests)  # every turn, the run's
    assert all(tuple(r.stop_token_ids)[0] == tokenizer.convert_tokens_to_ids("<|im_end|>")
               for r in requests)  # fmt: skip
    assert all(r.stop_token_sequences == () for r in requests)
    seeds = [r.seed for r in requests]
    assert len(set(seeds)) == 6

    engine2 = FakeEngine(tokenizer, engine.script)
    rollout2 = Rollout(engine2, tokenizer, config)
    rollout2.run_batch_sync(group_specs(FakeToolEnv, None, group_size=2, options={"task_index": 0}))
    assert sorted(r.seed for _, _, r in engine2.requests) == sorted(seeds)


def test_group_shares_the_task_and_group_id(tokenizer):
    engine = FakeEngine(tokenizer, lambda ep, turn: ANSWER)
    rollout = Rollout(engine, tokenizer)
    group = asyncio.run(
        rollout.run_group(FakeToolEnv, None, group_size=3, group_id=7, options={"task_index": 5})
    )
    assert [t.group_id for t in group] == [7, 7, 7]
    assert len({tuple(t.prompt_ids) for t in group}) == 1
    assert all(t.status == RolloutStatus.FINISHED for t in group)


def test_stop_at_tool_call_end_stops_there_and_renders_the_closing_token(tokenizer):
    engine = FakeEngine(
        tokenizer,
        lambda ep, turn: call("echo", text="a") + " trailing words" if turn == 0 else ANSWER,
    )
    (traj,) = run(engine, tokenizer, stop_at_tool_call_end=True)
    close_ids = tokenizer("</tool_call>", add_special_tokens=False)["input_ids"]
    (_, _, first_request), _ = engine.requests
    assert [list(s) for s in first_request.stop_token_sequences] == [close_ids]
    first = engine.results[(0, 0)].token_ids
    assert first[-len(close_ids) :] == close_ids
    assert traj.status == RolloutStatus.FINISHED
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    after = traj.completion_ids[len(first)]
    assert (after, traj.loss_mask[len(first)]) == (im_end, 0)


# ------------------------------------------------------------------------------- endings
def test_max_turns_ends_with_truncated_max_turns(tokenizer):
    engine = FakeEngine(tokenizer, lambda ep, turn: call("echo", text=f"t{turn}"))
    (traj,) = run(engine, tokenizer, max_turns=3)
    assert traj.status == RolloutStatus.TRUNCATED_MAX_TURNS
    assert len(model_segments(traj)) == 3
    assert traj.num_tool_calls == 3
    assert traj.loss_mask[-1] == 1  # the last env answer is not appended


def test_context_exhausted_ends_with_truncated_context_within_the_limit(tokenizer):
    engine = FakeEngine(tokenizer, lambda ep, turn: call("echo", text="long " * 20))
    (probe,) = run(FakeEngine(tokenizer, lambda ep, turn: ANSWER), tokenizer)
    limit = len(probe.prompt_ids) + 150
    (traj,) = run(engine, tokenizer, max_context_tokens=limit)
    assert traj.status == RolloutStatus.TRUNCATED_CONTEXT
    assert len(traj.prompt_ids) + len(traj.completion_ids) <= limit
    assert len(model_segments(traj)) >= 1


def test_turn_hitting_its_token_limit_ends_the_episode(tokenizer):
    engine = FakeEngine(tokenizer, lambda ep, turn: Reply("words " * 50, end=False))
    (traj,) = run(engine, tokenizer, max_tokens_per_turn=5)
    assert traj.status == RolloutStatus.TRUNCATED_TURN_LENGTH
    assert traj.loss_mask == [1] * 5


def test_cut_off_turn_can_be_closed_and_handed_to_the_env(tokenizer):
    engine = FakeEngine(
        tokenizer, lambda ep, turn: Reply("words " * 50, end=False) if turn == 0 else ANSWER
    )
    (traj,) = run(engine, tokenizer, max_tokens_per_turn=5, end_on_truncated_turn=False)
    assert traj.status == RolloutStatus.FINISHED
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert traj.completion_ids[5] == im_end and traj.loss_mask[5] == 0
    assert traj.messages[3].role == Role.USER  # the env nudged: no call, no answer


def test_too_many_malformed_calls_end_with_error_parse(tokenizer):
    bad = "<tool_call>\n{not json\n</tool_call>"
    engine = FakeEngine(tokenizer, lambda ep, turn: bad)
    (traj,) = run(engine, tokenizer, max_parse_errors=1)
    assert traj.status == RolloutStatus.ERROR_PARSE
    assert "2 malformed tool calls" in traj.error
    assert len(model_segments(traj)) == 2  # the first one was answered with an error message
    assert traj.messages[3].role == Role.TOOL and "JSON" in traj.messages[3].content


def test_env_step_that_raises_ends_that_episode_with_error_tool(tokenizer):
    engine = FakeEngine(tokenizer, lambda ep, turn: "CRASH_ENV" if ep == 1 else ANSWER)
    trajs = run(engine, tokenizer, 3)
    assert [t.status for t in trajs] == [
        RolloutStatus.FINISHED, RolloutStatus.ERROR_TOOL, RolloutStatus.FINISHED,
    ]  # fmt: skip
    assert "RuntimeError: bug in the environment" in trajs[1].error
    assert trajs[1].loss_mask and all(trajs[1].loss_mask)


def test_tool_that_raises_is_an_error_message_and_the_episode_goes_on(tokenizer):
    engine = FakeEngine(tokenizer, lambda ep, turn: call("explode") if turn == 0 else ANSWER)
    (traj,) = run(engine, tokenizer)
    assert traj.status == RolloutStatus.FINISHED
    assert (traj.num_tool_calls, traj.num_tool_errors) == (1, 1)
    assert "the explode tool exploded" in traj.messages[3].content


@pytest.mark.parametrize("marker", ["SANDBOX_DOWN", "SANDBOX_RESULT"])
def test_sandbox_failure_ends_with_error_sandbox(tokenizer, marker):
    engine = FakeEngine(tokenizer, lambda ep, turn: marker if ep == 0 else ANSWER)
    trajs = run(engine, tokenizer, 2)
    assert [t.status for t in trajs] == [RolloutStatus.ERROR_SANDBOX, RolloutStatus.FINISHED]
    assert "sandbox" in trajs[0].error


def test_engine_error_on_one_episode_leaves_the_others_finishing(tokenizer):
    def script(ep, turn):
        if ep == 1 and turn == 1:
            return EngineError("vLLM rejected the request: boom")
        return call("echo", text="x") if turn < 2 else ANSWER

    trajs = run(FakeEngine(tokenizer, script), tokenizer, 4)
    assert [t.status for t in trajs] == [
        RolloutStatus.FINISHED, RolloutStatus.ERROR_ENGINE,
        RolloutStatus.FINISHED, RolloutStatus.FINISHED,
    ]  # fmt: skip
    assert "turn 1: EngineError: vLLM rejected the request: boom" == trajs[1].error
    assert len(model_segments(trajs[1])) == 1


def test_env_that_fails_to_build_gives_an_empty_error_trajectory(tokenizer):
    def broken(**_):
        raise ValueError("bad env kwargs")

    engine = FakeEngine(tokenizer, lambda ep, turn: ANSWER)
    rollout = Rollout(engine, tokenizer)
    (traj,) = rollout.run_batch_sync(specs(1, make=broken))
    assert traj.status == RolloutStatus.ERROR_TOOL
    assert "ValueError: bad env kwargs" in traj.error
    assert traj.prompt_ids == [] and traj.completion_ids == []


def test_hanging_tool_times_out_while_the_others_finish(tokenizer):
    release = threading.Event()
    engine = FakeEngine(
        tokenizer,
        lambda ep, turn: call("wait_for_release") if ep == 0 and turn == 0 else ANSWER,
    )
    try:
        trajs = run(engine, tokenizer, 3, env_kwargs={"release": release}, tool_call_timeout_s=0.2)
    finally:
        release.set()  # let the abandoned thread end
    assert [t.status for t in trajs] == [
        RolloutStatus.ERROR_TOOL, RolloutStatus.FINISHED, RolloutStatus.FINISHED,
    ]  # fmt: skip
    assert "did not return within 0.2 s" in trajs[0].error


# ----------------------------------------------------------------------------- concurrency
def test_other_episodes_keep_generating_while_one_waits_on_its_tool(tokenizer):
    log, release = EventLog(), threading.Event()
    others = {1, 2, 3}
    finished: set[int] = set()

    def on_generate(ep, turn):
        if ep in others and turn == 3:
            finished.add(ep)
            if finished == others:
                release.set()

    def script(ep, turn):
        if ep == 0:
            return call("wait_for_release") if turn == 0 else ANSWER
        return call("echo", text=f"{ep}/{turn}") if turn < 3 else ANSWER

    engine = FakeEngine(tokenizer, script, log=log, on_generate=on_generate)
    trajs = run(engine, tokenizer, 4, env_kwargs={"log": log, "release": release})

    assert all(t.status == RolloutStatus.FINISHED for t in trajs), [t.error for t in trajs]
    assert trajs[0].messages[3].content == "released"
    start, end = log.index("tool_start"), log.index("tool_end")
    for ep in others:
        assert start < log.index("generate", ep, 3) < end
    assert log.index("generate", 0, 1) > end


def test_max_concurrent_episodes_bounds_open_envs(tokenizer):
    active: list[int] = []
    engine = FakeEngine(tokenizer, lambda ep, turn: call("echo", text="x") if turn < 2 else ANSWER)
    trajs = run(engine, tokenizer, 6, env_kwargs={"active": active}, max_concurrent_episodes=2)
    assert all(t.status == RolloutStatus.FINISHED for t in trajs)
    assert sum(active) == 0 and active.count(1) == 6
    assert max_active(active) == 2


# ---------------------------------------------------------------------------------- config
def test_context_limit_above_the_engine_max_model_len_is_refused(tokenizer):
    engine = FakeEngine(tokenizer, lambda ep, turn: ANSWER, max_model_len=128)
    with pytest.raises(ConfigError, match="max_model_len=128"):
        Rollout(engine, tokenizer, Rollout.Config(max_context_tokens=256))


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_turns", 0),
        ("temperature", 0.0),
        ("tool_call_timeout_s", -1.0),
        ("max_parse_errors", -1),
    ],
)
def test_invalid_config_values_raise_config_error(field, value):
    with pytest.raises(ConfigError, match=field):
        Rollout.Config(**{field: value}).validate()


# ----------------------------------------------------------------------------------- report
def test_report_shows_turns_calls_and_status_and_jsonl_round_trips(tokenizer, tmp_path):
    import json

    from tir_rl.report.trajectory_text import format_summary, format_trajectory, write_jsonl

    script = {0: call("echo", text=UNICODE_TEXT), 1: ANSWER}
    (traj,) = run(FakeEngine(tokenizer, lambda ep, turn: script[turn]), tokenizer)
    text = format_trajectory(traj, index=0, max_chars=0)
    assert "status finished" in text and "reward 1" in text and "turns 2" in text
    assert '→ call echo({"text": "' + UNICODE_TEXT + '"})' in text
    assert f"tool[echo] │ {UNICODE_TEXT}" in text
    assert "1 episodes │ mean reward 1.000" in format_summary([traj])
    (row,) = [json.loads(line) for line in write_jsonl([traj], tmp_path / "t.jsonl").open()]
    assert row["completion_ids"] == traj.completion_ids
    assert row["status"] == "finished" and row["messages"][3]["content"] == UNICODE_TEXT


class TypedStepInfoEnv(FakeToolEnv):
    """Breaks the Gymnasium API: step's info is a dataclass, not a dict."""

    def step(self, action):
        from tir_rl.envs import StepInfo

        messages, reward, terminated, truncated, info = super().step(action)
        return messages, reward, terminated, truncated, StepInfo.from_info(info)


def test_env_whose_info_is_not_a_dict_ends_that_episode_with_the_reason(tokenizer):
    engine = FakeEngine(tokenizer, lambda ep, turn: call("explode") if turn == 0 else ANSWER)
    rollout = Rollout(engine, tokenizer, Rollout.Config())
    (traj,) = rollout.run_batch_sync(specs(1, make=TypedStepInfoEnv))
    assert traj.status == RolloutStatus.ERROR_TOOL
    assert "info must be a dict (the Gymnasium API), got StepInfo" in traj.error


# ---------------------------------------------------------------------------- chat format
def test_the_rollout_renders_in_the_configured_chat_format(tokenizer):
    from tir_rl.chat import ChatFormatName

    engine = FakeEngine(tokenizer, lambda ep, turn: ANSWER)
    chat = ChatFormat.Config(format=ChatFormatName.CHATML, tool_instructions="TOOLS:\n{tools}")
    rollout = Rollout(engine, tokenizer, chat_config=chat)
    (traj,) = rollout.run_batch_sync(specs(1))
    assert traj.status == RolloutStatus.FINISHED, traj.error
    prompt = rollout.chat_format_for(FakeToolEnv().tools.json_schemas).decode(traj.prompt_ids)
    assert "\n\nTOOLS:\n{" in prompt and "# Tools" not in prompt


def test_a_chat_format_the_tokenizer_cannot_carry_stops_the_rollout_before_it_starts(tokenizer):
    from tir_rl.chat import ChatFormatName
    from tir_rl.errors import ChatFormatError

    engine = FakeEngine(tokenizer, lambda ep, turn: ANSWER)
    chat = ChatFormat.Config(format=ChatFormatName.LLAMA3)
    with pytest.raises(ChatFormatError, match="<\\|begin_of_text\\|>"):
        Rollout(engine, tokenizer, chat_config=chat)
    assert engine.requests == []


def test_a_cancel_that_arrives_with_the_env_call_s_result_still_cancels():
    """The run stops just as a blocking env call returns: the episode must not play on.

    (`asyncio.wait_for` on Python 3.11 returned the result and dropped the cancellation; a
    stopped producer then waited its whole timeout for episodes that kept playing.)
    """
    import time

    from tir_rl.rollout.episode import run_blocking

    async def main() -> None:
        release = threading.Event()
        task = asyncio.create_task(
            run_blocking(lambda: release.wait(5), timeout_s=30, name="env.step")
        )
        await asyncio.sleep(0.05)  # the call runs in its thread
        release.set()
        time.sleep(0.5)  # holds the loop while the call returns and queues its result
        task.cancel()  # in the same loop iteration as the queued result
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
