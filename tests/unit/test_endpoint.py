"""The OpenAI-compatible endpoint's logic: TITO reuse, recording, samples, refusals.

A scripted fake engine stands in for vLLM (the real one is in
tests/integration/endpoint/test_endpoint_vllm.py); the tokenizer and chat format are real.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from transformers import AutoTokenizer

from tir_rl.chat import ChatFormat
from tir_rl.endpoint import (
    CallRecorder,
    ChatEndpoint,
    EndpointConfig,
    EndpointServer,
    RequestError,
    samples_from_calls,
)
from tir_rl.engine.base import FinishReason, GenerateRequest, GenerateResult, ModelInfo
from tir_rl.models import prepare_bundled_model
from tir_rl.types import UNVERSIONED, RolloutStatus

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up.",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
        },
    }
]
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"word": "ada"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(prepare_bundled_model())


class FakeTextEngine:
    """Fake engine: answers each request with `reply(request)` tokenized, then `<|im_end|>`."""

    def __init__(self, tokenizer: Any, reply: Callable[[GenerateRequest], str]) -> None:
        self.tokenizer = tokenizer
        self.reply = reply
        self.requests: list[GenerateRequest] = []
        self.policy_version = 3
        self.end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")

    @property
    def model_info(self) -> ModelInfo:
        return ModelInfo(
            model_path="/models/fake-model",
            dtype="float32",
            max_model_len=2048,
            logprobs_mode="processed_logprobs",
        )

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.requests.append(request)
        ids = self.tokenizer.encode(self.reply(request), add_special_tokens=False)
        ids = [*ids[: request.max_tokens - 1], self.end_id]
        return GenerateResult(
            token_ids=ids,
            logprobs=[-0.25] * len(ids),
            finish_reason=FinishReason.STOP,
            policy_versions=[self.policy_version] * len(ids),
        )


def endpoint_with(tokenizer: Any, *replies: str) -> tuple[ChatEndpoint, FakeTextEngine]:
    queue = list(replies)
    engine = FakeTextEngine(tokenizer, lambda request: queue.pop(0))
    return ChatEndpoint(engine, tokenizer, config=EndpointConfig(max_tokens_per_call=64)), engine


def complete(endpoint: ChatEndpoint, episode: str, **body: Any) -> dict[str, Any]:
    return asyncio.run(endpoint.complete(episode, body))


def test_a_follow_up_call_reuses_the_sampled_tokens_and_joins_one_sample(tokenizer):
    endpoint, engine = endpoint_with(tokenizer, f"Let me look.\n{CALL}", "It is a name.")
    question = [{"role": "user", "content": "What is ada?"}]
    first = complete(endpoint, "e1", messages=question, tools=TOOLS, logprobs=True)
    choice = first["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look."
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "lookup"
    assert json.loads(call["function"]["arguments"]) == {"word": "ada"}
    entries = choice["logprobs"]["content"]
    assert len(entries) == first["usage"]["completion_tokens"]
    assert {e["logprob"] for e in entries} == {-0.25}

    follow_up = [
        *question,
        choice["message"],
        {"role": "tool", "tool_call_id": call["id"], "content": "a programmer"},
    ]
    second = complete(endpoint, "e1", messages=follow_up, tools=TOOLS)
    assert second["choices"][0]["message"]["content"] == "It is a name."

    calls = endpoint.recorder.calls("e1")
    assert calls[1].extends_call == (0, 0)
    assert calls[1].prompt_ids[: len(calls[0].token_ids)] == calls[0].token_ids
    fmt = ChatFormat(tokenizer, tool_schemas=TOOLS)
    gap = calls[1].prompt_ids[len(calls[0].token_ids) :]
    assert fmt.decode(gap) == (  # the tool turn rendered by the chat format, then the header
        "\n<|im_start|>tool\n<tool_response>\na programmer\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )

    (sample,) = samples_from_calls(calls, reward=1.0, group_id=4)
    n0, n1, g = len(calls[0].completion_ids), len(calls[1].completion_ids), len(gap)
    assert sample.prompt_ids == calls[0].prompt_ids
    assert sample.loss_mask == [1] * n0 + [0] * g + [1] * n1
    assert sample.turn_ids == [0] * (n0 + g) + [1] * n1
    assert sample.policy_versions == [3] * n0 + [UNVERSIONED] * g + [3] * n1
    assert sample.sampler_logprobs == [-0.25] * n0 + [0.0] * g + [-0.25] * n1
    assert (sample.reward, sample.group_id, sample.num_tool_calls) == (1.0, 4, 1)


def test_a_rewritten_history_starts_a_new_sample_with_the_same_reward(tokenizer):
    endpoint, _ = endpoint_with(tokenizer, CALL, "Summary noted.", "Done.")
    question = [{"role": "user", "content": "What is ada?"}]
    first = complete(endpoint, "e2", messages=question, tools=TOOLS)["choices"][0]["message"]
    call_id = first["tool_calls"][0]["id"]
    complete(
        endpoint,
        "e2",
        messages=[*question, first, {"role": "tool", "tool_call_id": call_id, "content": "x"}],
        tools=TOOLS,
    )
    compacted = [{"role": "user", "content": "Earlier you looked ada up: x. Answer now."}]
    complete(endpoint, "e2", messages=compacted, tools=TOOLS)

    calls = endpoint.recorder.take("e2")
    assert [c.extends_call for c in calls] == [None, (0, 0), None]
    samples = samples_from_calls(calls, reward=0.5, episode_id=9)
    assert len(samples) == 2
    assert [s.reward for s in samples] == [0.5, 0.5]
    assert [s.episode_id for s in samples] == [9, 9]
    assert sum(s.num_model_tokens for s in samples) == sum(len(c.completion_ids) for c in calls)
    assert endpoint.recorder.calls("e2") == []


def test_each_of_n_choices_is_recorded_and_the_continued_one_extends_its_own_sample(tokenizer):
    endpoint, engine = endpoint_with(tokenizer, "Alpha.", "Beta.", "Gamma.")
    question = [{"role": "user", "content": "Say a word."}]
    response = complete(endpoint, "e3", messages=question, n=2, seed=5)
    assert [c["message"]["content"] for c in response["choices"]] == ["Alpha.", "Beta."]
    assert [r.seed for r in engine.requests] == [5, 6]
    beta = response["choices"][1]["message"]
    complete(endpoint, "e3", messages=[*question, beta, {"role": "user", "content": "Again."}])
    calls = endpoint.recorder.calls("e3")
    assert calls[2].extends_call == (0, 1)
    samples = samples_from_calls(calls, reward=0.0)
    assert [s.num_model_tokens for s in samples] == [
        len(calls[0].completion_ids),
        len(calls[1].completion_ids) + len(calls[2].completion_ids),
    ]


def test_a_malformed_call_stays_in_the_text_the_client_reads(tokenizer):
    bad = '<tool_call>\n{"name": "lookup", "arguments": {oops}\n</tool_call>'
    endpoint, _ = endpoint_with(tokenizer, bad)
    message = complete(endpoint, "e4", messages=[{"role": "user", "content": "Go."}], tools=TOOLS)
    choice = message["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == bad


def test_tool_choice_none_hides_the_tools(tokenizer):
    endpoint, engine = endpoint_with(tokenizer, "No tools.", "Tools.")
    question = [{"role": "user", "content": "Hi."}]
    complete(endpoint, "e5", messages=question, tools=TOOLS, tool_choice="none")
    complete(endpoint, "e6", messages=question, tools=TOOLS)
    hidden, shown = (tokenizer.decode(r.prompt_token_ids) for r in engine.requests)
    assert "lookup" not in hidden and "lookup" in shown


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("temperature", 0.7, "differs from the endpoint's 1.0"),
        ("top_p", 0.9, "top_p 0.9 differs from the run's 1.0"),
        ("top_k", 20, "top_k 20 differs from the run's None"),
        ("min_p", "x", "'min_p' must be a number"),
        ("tool_choice", "required", "forcing a call"),
        ("stream", "yes", "'stream' must be true or false"),
        ("stop", ["\n"], "token ids"),
        ("logit_bias", {"5": 2}, "logit_bias"),
        ("frobnicate", 1, "unknown request field"),
        ("max_completion_tokens", 5000, "the context holds 2048"),
        ("response_format", {"type": "json_object"}, "constrained decoding"),
        ("n", 17, "at most 16 choices"),
        ("messages", [{"role": "tool", "tool_call_id": "x", "content": "4"}], "answers no tool"),
        ("messages", [{"role": "user", "content": "word " * 2100}], "shorten the conversation"),
    ],
)
def test_what_the_sampler_cannot_honour_is_refused_with_a_reason(tokenizer, field, value, says):
    endpoint, engine = endpoint_with(tokenizer, "unused")
    body = {"messages": [{"role": "user", "content": "Hi."}], field: value}
    with pytest.raises(RequestError, match=says) as refused:
        complete(endpoint, "e7", **body)
    assert engine.requests == []
    assert endpoint.recorder.calls("e7") == []
    assert not re.search(r"-\d", str(refused.value))  # no negative token counts


def test_the_run_s_temperature_is_accepted_and_used(tokenizer):
    endpoint, engine = endpoint_with(tokenizer, "Ok.")
    complete(endpoint, "e8", messages=[{"role": "user", "content": "Hi."}], temperature=1.0)
    assert engine.requests[0].temperature == 1.0


def test_the_run_s_truncation_is_sampled_and_a_request_may_repeat_it(tokenizer):
    from tir_rl.engine.truncation import SamplingTruncation

    engine = FakeTextEngine(tokenizer, lambda request: "Ok.")
    cut = SamplingTruncation(top_p=0.9, top_k=20, min_p=0.05)
    endpoint = ChatEndpoint(engine, tokenizer, config=EndpointConfig(truncation=cut))
    hi = [{"role": "user", "content": "Hi."}]
    complete(endpoint, "e9", messages=hi)
    complete(endpoint, "e10", messages=hi, top_p=0.9, top_k=20, min_p=0.05)
    assert {r.truncation for r in engine.requests} == {cut}
    with pytest.raises(RequestError, match="top_p 1.0 differs from the run's 0.9"):
        complete(endpoint, "e12", messages=hi, top_p=1.0)


def test_a_run_s_endpoint_serves_only_the_episodes_the_run_opened(tokenizer):
    engine = FakeTextEngine(tokenizer, lambda request: "Ok.")
    endpoint = ChatEndpoint(
        engine,
        tokenizer,
        recorder=CallRecorder(open_on_first_call=False),
        config=EndpointConfig(max_tokens_per_call=64),
    )
    hello = [{"role": "user", "content": "Hi."}]
    with pytest.raises(RequestError, match="not open in this run") as refused:
        complete(endpoint, "made-up", messages=hello)
    assert refused.value.status == 404 and engine.requests == []  # nothing was sampled
    endpoint.recorder.open("g0-e0")
    complete(endpoint, "g0-e0", messages=hello)
    endpoint.recorder.discard("g0-e0")  # the episode ended
    with pytest.raises(RequestError, match="not open in this run"):
        complete(endpoint, "g0-e0", messages=hello)
    assert len(engine.requests) == 1 and endpoint.recorder.episode_ids == []
    import httpx

    endpoint.recorder.open("g0-e1")
    with EndpointServer(endpoint) as server:  # an agent cannot end its episode early
        finish = httpx.post(
            f"{server.url}/episodes/g0-e1/finish",
            json={"reward": 1.0},
            headers={"Authorization": f"Bearer {server.api_key}"},
        )
    assert finish.status_code == 403 and endpoint.recorder.episode_ids == ["g0-e1"]


def test_the_official_openai_client_talks_to_the_server_and_the_episode_is_finished(tokenizer):
    openai = pytest.importorskip("openai")
    endpoint, _ = endpoint_with(tokenizer, f"Checking.\n{CALL}", "Ada is a name.")
    with EndpointServer(endpoint) as server:
        client = openai.OpenAI(base_url=server.episode_base_url("ep-1"), api_key=server.api_key)
        assert [m.id for m in client.models.list().data] == ["fake-model"]
        question = [{"role": "user", "content": "What is ada?"}]
        first = client.chat.completions.create(model="any", messages=question, tools=TOOLS)
        message = first.choices[0].message
        assert message.tool_calls[0].function.name == "lookup"
        follow_up = [
            *question,
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "a name"},
        ]
        second = client.chat.completions.create(model="any", messages=follow_up, tools=TOOLS)
        assert second.choices[0].message.content == "Ada is a name."
        with pytest.raises(openai.BadRequestError, match="top_p"):
            client.chat.completions.create(model="any", messages=question, top_p=0.5)

        import httpx

        key = {"Authorization": f"Bearer {server.api_key}"}
        recorded = httpx.get(f"{server.url}/episodes/ep-1", headers=key).json()["calls"]
        assert [c["extends_call"] for c in recorded] == [None, [0, 0]]
        finish = f"{server.url}/episodes/ep-1/finish"
        finished = httpx.post(finish, json={"reward": 1}, headers=key).json()
        (sample,) = finished["samples"]
        assert sample["reward"] == 1.0 and sum(sample["loss_mask"]) == sum(
            len(c["completion_ids"]) for c in recorded
        )
        gone = httpx.post(finish, json={"reward": 1}, headers=key)
        assert gone.status_code == 404 and "no call was recorded" in gone.text


def test_a_streamed_request_gets_the_recorded_completion_as_chunks(tokenizer):
    openai = pytest.importorskip("openai")
    endpoint, _ = endpoint_with(tokenizer, f"Checking.\n{CALL}", "Ada is a name.")
    with EndpointServer(endpoint) as server:
        client = openai.OpenAI(base_url=server.episode_base_url("ep-s"), api_key=server.api_key)
        question = [{"role": "user", "content": "What is ada?"}]
        with client.chat.completions.stream(
            model="any",
            messages=question,
            tools=TOOLS,
            logprobs=True,
            stream_options={"include_usage": True},
        ) as stream:
            first = stream.get_final_completion()
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls"
        assert message.content == "Checking."
        assert message.tool_calls[0].function.name == "lookup"
        assert json.loads(message.tool_calls[0].function.arguments) == {"word": "ada"}
        (call,) = endpoint.recorder.calls("ep-s")
        assert [e.logprob for e in first.choices[0].logprobs.content] == call.logprobs
        assert first.usage.completion_tokens == len(call.completion_ids)
        # The streamed turn, sent back, is the sampled one: the follow-up extends its tokens.
        follow_up = [
            *question,
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "a name"},
        ]
        chunks = list(
            client.chat.completions.create(
                model="any", messages=follow_up, tools=TOOLS, stream=True
            )
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Ada is a name."
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert all(c.usage is None for c in chunks)
    assert [c.extends_call for c in endpoint.recorder.calls("ep-s")] == [None, (0, 0)]


def test_a_failed_agent_s_samples_carry_its_status(tokenizer):
    endpoint, _ = endpoint_with(tokenizer, "Hm.")
    complete(endpoint, "e9", messages=[{"role": "user", "content": "Hi."}])
    (sample,) = samples_from_calls(
        endpoint.recorder.take("e9"),
        reward=0.0,
        status=RolloutStatus.ERROR_AGENT,
        error="ValueError: boom",
    )
    assert sample.status == RolloutStatus.ERROR_AGENT and sample.error == "ValueError: boom"


def test_without_an_episode_path_the_headers_name_the_episode(tokenizer):
    import httpx

    endpoint, _ = endpoint_with(tokenizer, "One.", "Two.", "Three.")
    body = {"messages": [{"role": "user", "content": "Hi."}]}
    with EndpointServer(endpoint) as server:
        url = f"{server.url}/v1/chat/completions"
        key = {"Authorization": f"Bearer {server.api_key}"}
        named = httpx.post(url, json=body, headers={"X-Episode-Id": "ep-x", **key})
        session = httpx.post(url, json=body, headers={"X-Session-ID": "rollout-7", **key})
        fresh = httpx.post(url, json=body, headers=key)
    assert named.headers["x-episode-id"] == "ep-x"
    assert session.headers["x-episode-id"] == "rollout-7"
    assert len(endpoint.recorder.calls("rollout-7")) == 1
    assert fresh.headers["x-episode-id"] not in ("ep-x", "rollout-7")
    assert sorted(endpoint.recorder.episode_ids) == sorted(
        ["ep-x", "rollout-7", fresh.headers["x-episode-id"]]
    )


def test_every_route_refuses_a_caller_without_the_server_s_key(tokenizer):
    import httpx

    endpoint, _ = endpoint_with(tokenizer, "Recorded.")
    body = {"messages": [{"role": "user", "content": "Hi."}]}
    with EndpointServer(endpoint) as server:
        complete(endpoint, "kept", messages=[{"role": "user", "content": "Hi."}])
        routes = [
            ("POST", "/v1/chat/completions", body),
            ("POST", "/episodes/e1/v1/chat/completions", body),
            ("GET", "/v1/models", None),
            ("GET", "/episodes/e1/v1/models", None),
            ("GET", "/episodes/kept", None),
            ("POST", "/episodes/kept/finish", {"reward": 1}),
            ("GET", "/health", None),
        ]
        for wrong in ({}, {"Authorization": "Bearer not-the-key"}, {"Authorization": "x"}):
            for method, path, json_body in routes:
                answer = httpx.request(method, server.url + path, json=json_body, headers=wrong)
                assert answer.status_code == 401, (method, path, wrong, answer.text)
        key = {"Authorization": f"Bearer {server.api_key}"}
        assert httpx.get(f"{server.url}/health", headers=key).status_code == 200
    # Nothing was sampled, recorded or taken by the refused calls.
    assert sorted(endpoint.recorder.episode_ids) == ["kept"]
    assert len(endpoint.recorder.calls("kept")) == 1


def test_a_body_too_large_for_the_context_is_refused_before_it_is_read(tokenizer):
    import httpx

    endpoint, engine = endpoint_with(tokenizer, "unused")
    limit = endpoint.max_request_bytes
    assert limit == 64 * 2048 + (1 << 20)
    big = {"messages": [{"role": "user", "content": "x" * limit}]}
    with EndpointServer(endpoint) as server:
        key = {"Authorization": f"Bearer {server.api_key}"}
        url = f"{server.url}/episodes/big/v1/chat/completions"
        answer = httpx.post(url, json=big, headers=key, timeout=30)
        assert answer.status_code == 413 and "shorten the conversation" in answer.text

        def chunks():  # no Content-Length: the stream is cut at the limit
            yield b'{"messages": [{"role": "user", "content": "'
            for _ in range(limit // 65536 + 2):
                yield b"x" * 65536
            yield b'"}]}'

        answer = httpx.post(url, content=chunks(), headers=key, timeout=30)
        assert answer.status_code == 413
    assert engine.requests == [] and endpoint.recorder.episode_ids == []
