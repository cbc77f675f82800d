import pytest
import torch

from tir_rl.report.run_log import keep_steps_up_to
from tir_rl.report.sequences import (
    append_sequences,
    read_sequences,
    sequence_records,
)
from tir_rl.trainer.batch import TrainBatch
from tir_rl.types import Trajectory


def traj(sampler: list[float], *, reward: float, group: int) -> Trajectory:
    n = len(sampler)
    return Trajectory(
        prompt_ids=[100, 101],
        completion_ids=list(range(1, n + 1)),
        loss_mask=[1] * (n - 1) + [0],  # the last token is a tool result
        sampler_logprobs=sampler,
        turn_ids=[0] * n,
        reward=reward,
        group_id=group,
        policy_versions=[3] * n,
    )


@pytest.fixture
def batch() -> TrainBatch:
    return TrainBatch.from_trajectories(
        [
            traj([-1.0, -2.0, -3.0, 0.0], reward=1.0, group=7),
            traj([-1.0, -1.0, 0.0], reward=0.0, group=7),
        ]
    )


def test_records_hold_each_sequences_ratio_mask_and_advantage(batch):
    trainer = torch.tensor([[-1.5, -2.0, -2.0, -9.0], [-1.0, -0.5, 0.0, 0.0]])
    kept = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    weights = torch.tensor([[0.5, 0.0, 1.5, 0.0], [1.0, 1.0, 0.0, 0.0]])
    first, second = sequence_records(
        4, batch, trainer, advantages=torch.tensor([0.7, -0.7]), kept=kept, weights=weights,
        trained_version=5,
    )  # fmt: skip
    # row 0: log ratios over its 3 model tokens: -0.5, 0, +1 (the tool token's -9 is not one)
    assert (first.model_tokens, first.kept_tokens) == (3, 2)
    assert first.log_ratio_sum == pytest.approx(0.5)
    assert first.log_ratio_mean == pytest.approx(0.5 / 3)
    assert (first.log_ratio_min, first.log_ratio_max) == (-0.5, 1.0)
    assert first.is_weight_mean == pytest.approx(1.0)  # (0.5 + 1.5) / 2 kept tokens
    assert (first.step, first.group_id, first.reward, first.lag_max) == (4, 7, 1.0, 2)
    assert first.advantage == pytest.approx(0.7)
    assert (second.model_tokens, second.kept_tokens, second.log_ratio_sum) == (2, 2, 0.5)
    assert second.advantage == pytest.approx(-0.7)


def test_a_scoring_pass_records_no_advantage_and_no_correction(batch):
    records = sequence_records(
        1, batch, batch.sampler_logprobs, advantages=None, kept=None, weights=None,
        trained_version=3,
    )  # fmt: skip
    assert [(r.advantage, r.kept_tokens, r.is_weight_mean) for r in records] == [(None,) * 3] * 2
    assert [r.log_ratio_sum for r in records] == [0.0, 0.0]


def test_a_resumed_run_drops_the_records_of_the_steps_it_replays(tmp_path, batch):
    path = tmp_path / "sequences.jsonl"
    for step in (1, 2, 3):
        append_sequences(path, sequence_records(
            step, batch, batch.sampler_logprobs, advantages=None, kept=None, weights=None,
            trained_version=3,
        ))  # fmt: skip
    with path.open("a") as file:
        file.write('{"step": 3, "group_id": 0, "adv')  # the line a SIGKILL cut
    keep_steps_up_to(path, 2)
    assert [r.step for r in read_sequences(path)] == [1, 1, 2, 2]
    keep_steps_up_to(tmp_path / "absent.jsonl", 0)  # a fresh run: nothing to cut


def test_a_kept_gzip_copy_reads_back_the_same_records(tmp_path, batch):
    import gzip

    path = tmp_path / "sequences.jsonl"
    append_sequences(path, sequence_records(
        1, batch, batch.sampler_logprobs, advantages=None, kept=None, weights=None,
        trained_version=3,
    ))  # fmt: skip
    packed = tmp_path / "sequences.jsonl.gz"
    packed.write_bytes(gzip.compress(path.read_bytes()))
    assert read_sequences(packed) == read_sequences(path)
    assert len(read_sequences(packed)) == 2
