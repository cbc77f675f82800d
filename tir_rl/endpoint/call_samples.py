"""An episode's recorded calls as training samples (token-level `Trajectory`s).

A call whose prompt starts with a sample's tokens, token for token, joins that sample: the
tokens in between (the tool results and user turns the client added, and the next assistant
header) are appended with loss mask 0, then the sampled ids with loss mask 1. A call whose
prompt extends no sample (the harness compacted or summarised its history, a template
dropped earlier reasoning, a sub-agent started its own conversation, or another choice of
`n` already extended the sample) starts a new sample. Every sample of an episode gets the
episode's reward; `Trajectory.episode_id` ties them together, so that GRPO counts the
episode once in its group (`tir_rl.trainer.loss.group_advantages`).

Turn indices follow `tir_rl.chat.Conversation`: a sample's k-th sampled turn has index k,
and the tokens appended after it carry k as well.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tir_rl.endpoint.recorder import RecordedCall
from tir_rl.engine.base import FinishReason
from tir_rl.types import UNVERSIONED, RolloutStatus, Trajectory

__all__ = ["samples_from_calls"]


@dataclass
class _Sample:
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_ids: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    calls: list[RecordedCall] = field(default_factory=list)

    @property
    def turns(self) -> int:
        return len(self.calls)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def extends_to(self, prompt_ids: Sequence[int]) -> bool:
        n = len(self.prompt_ids) + len(self.completion_ids)
        return n <= len(prompt_ids) and list(prompt_ids[:n]) == self.token_ids

    def add(self, call: RecordedCall) -> None:
        gap = call.prompt_ids[len(self.prompt_ids) + len(self.completion_ids) :]
        if self.calls:
            self._extend(gap, 0, [0.0] * len(gap), [UNVERSIONED] * len(gap), self.turns - 1)
        self._extend(call.completion_ids, 1, call.logprobs, call.policy_versions, self.turns)
        self.calls.append(call)

    def _extend(
        self, ids: Sequence[int], mask: int, logprobs: Sequence[float], versions: Sequence[int],
        turn: int,
    ) -> None:  # fmt: skip
        self.completion_ids.extend(ids)
        self.loss_mask.extend([mask] * len(ids))
        self.logprobs.extend(logprobs)
        self.versions.extend(versions)
        self.turn_ids.extend([turn] * len(ids))


def samples_from_calls(
    calls: Sequence[RecordedCall],
    *,
    reward: float,
    group_id: int = 0,
    episode_id: int | None = None,
    status: RolloutStatus = RolloutStatus.FINISHED,
    error: str | None = None,
) -> list[Trajectory]:
    """Split one episode's calls (call order) into samples sharing `reward`.

    A sample whose last sampled turn hit its token limit gets `TRUNCATED_TURN_LENGTH` unless
    `status` says the episode failed.
    """
    samples: list[_Sample] = []
    for call in sorted(calls, key=lambda c: (c.call_index, c.choice_index)):
        extendable = [s for s in samples if s.extends_to(call.prompt_ids)]
        if extendable:
            sample = max(extendable, key=lambda s: len(s.prompt_ids) + len(s.completion_ids))
        else:
            sample = _Sample(prompt_ids=list(call.prompt_ids))
            samples.append(sample)
        sample.add(call)
    out = []
    for sample in samples:
        last = sample.calls[-1]
        sample_status = status
        if status == RolloutStatus.FINISHED and last.finish_reason == FinishReason.LENGTH:
            sample_status = RolloutStatus.TRUNCATED_TURN_LENGTH
        out.append(
            Trajectory(
                prompt_ids=sample.prompt_ids,
                completion_ids=sample.completion_ids,
                loss_mask=sample.loss_mask,
                sampler_logprobs=sample.logprobs,
                turn_ids=sample.turn_ids,
                policy_versions=sample.versions,
                reward=reward,
                status=sample_status,
                group_id=group_id,
                episode_id=episode_id,
                num_tool_calls=sum(len(c.response.tool_calls) for c in sample.calls),
                messages=[*last.messages, last.response],
                error=error,
            )
        )
    return out
