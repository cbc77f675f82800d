import pytest
import torch
from group_trajectories import group_batch

from tir_rl.errors import ConfigError
from tir_rl.trainer.batch import MicroBatch, Packing, TrainBatch
from tir_rl.trainer.packing import plan_micro_batches
from tir_rl.trainer.prefix_sharing import common_prefix_length
from tir_rl.trainer.rows import sequence_tokens
from tir_rl.types import Trajectory


def traj(prompt_len: int, completion_len: int, *, start: int = 1) -> Trajectory:
    completion = list(range(start, start + completion_len))
    return Trajectory(
        prompt_ids=list(range(100, 100 + prompt_len)),
        completion_ids=completion,
        loss_mask=[1, 0] * (completion_len // 2) + [1] * (completion_len % 2),
        sampler_logprobs=[-float(t) for t in completion],
        turn_ids=[0] * completion_len,
        reward=float(completion_len),
        group_id=completion_len % 2,
    )


@pytest.fixture
def batch() -> TrainBatch:
    return TrainBatch.from_trajectories(
        [traj(3, 5), traj(1, 12, start=20), traj(4, 2, start=40), traj(2, 7, start=60)]
    )


def test_from_trajectories_pads_per_token_lists(batch):
    assert batch.completion_ids.shape == (4, 12)
    assert batch.completion_lens.tolist() == [5, 12, 2, 7]
    assert batch.completion_ids[0].tolist() == [1, 2, 3, 4, 5] + [0] * 7
    assert batch.loss_mask[0].tolist() == [True, False, True, False, True] + [False] * 7
    assert batch.sampler_logprobs[2, :2].tolist() == [-40.0, -41.0]
    assert batch.turn_ids[2].tolist() == [0, 0] + [-1] * 10
    assert batch.total_lens.tolist() == [8, 13, 6, 9]
    assert batch.rewards.tolist() == [5.0, 12.0, 2.0, 7.0]


def test_empty_prompt_is_refused():
    with pytest.raises(ConfigError, match="empty prompt"):
        TrainBatch.from_trajectories([traj(0, 3)])


@pytest.mark.parametrize("packing", list(Packing))
@pytest.mark.parametrize("budget", [1, 9, 14, 20, 1000])
def test_plan_covers_every_completion_token_once_with_its_predicting_position(
    batch, packing, budget
):
    seen = torch.zeros(batch.completion_ids.shape, dtype=torch.int64)
    for mb in plan_micro_batches(batch, budget, packing):
        # Over budget only when a single sequence alone is longer than the budget.
        assert mb.num_padded_tokens <= budget or len(mb.seq_indices) == 1
        seq = mb.seq_indices[mb.dest_seq]
        seen[seq, mb.dest_tok] += 1
        assert torch.equal(mb.targets, batch.completion_ids[seq, mb.dest_tok])
        # The predicting position is the token's own position in its sequence minus one.
        prompt_lens = torch.tensor([len(batch.prompt_ids[int(i)]) for i in seq])
        assert torch.equal(mb.position_ids[mb.row, mb.pred_pos], prompt_lens + mb.dest_tok - 1)
        assert_each_token_sees_exactly_its_own_context(batch, mb)
    valid = torch.arange(12)[None] < batch.completion_lens[:, None]
    assert torch.equal(seen, valid.long())


def attention_mask(mb: MicroBatch) -> torch.Tensor:
    """[R, W, W] bool: what each query column attends, as the model will see it."""
    if mb.prefix_layout is not None:
        return mb.prefix_layout.dense_mask()[:, 0]
    # No explicit mask: transformers derives a block-diagonal causal one from the positions.
    segment = torch.cumsum(mb.position_ids == 0, dim=1)
    width = mb.input_ids.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    return causal & (segment[:, :, None] == segment[:, None, :])


def assert_each_token_sees_exactly_its_own_context(batch: TrainBatch, mb: MicroBatch) -> None:
    """The keys visible from a token's predicting column are its sequence's earlier tokens,
    in order, at their own positions: no more (another branch, another sequence), no less."""
    mask = attention_mask(mb)
    for k in range(len(mb.targets)):
        i = int(mb.seq_indices[mb.dest_seq[k]])
        tokens, p, _ = sequence_tokens(batch, i)
        upto = p + int(mb.dest_tok[k])  # the predicting index is upto - 1
        row, column = int(mb.row[k]), int(mb.pred_pos[k])
        visible = mask[row, column]
        assert torch.equal(mb.input_ids[row][visible], tokens[:upto])
        assert torch.equal(mb.position_ids[row][visible], torch.arange(upto))
        assert int(mb.targets[k]) == int(tokens[upto])


def test_packed_rows_restart_positions_and_stay_within_the_longest_sequence():
    lengths = [30, 9, 11, 14, 12, 3]  # completion lengths; every prompt has 1 token
    batch = TrainBatch.from_trajectories([traj(1, n) for n in lengths])
    plans = plan_micro_batches(batch, 64, Packing.PACKED)
    longest = int(batch.total_lens.max())
    rows = [(mb, r) for mb in plans for r in range(mb.input_ids.shape[0])]
    assert all(mb.input_ids.shape[1] <= longest for mb, _ in rows)
    # Total lengths 31 | 15 + 13 | 12 + 10 + 4: three rows instead of six sequences.
    assert len(rows) == 3
    assert sum(mb.num_padded_tokens for mb in plans) < 6 * longest
    starts = sum(int((mb.position_ids[r] == 0).sum()) for mb, r in rows)
    assert starts == len(lengths)


def test_bucketed_sorts_by_length_and_pads_less_than_batch_order():
    lengths = [40, 3, 38, 2, 41, 4]
    batch = TrainBatch.from_trajectories([traj(1, n) for n in lengths])
    bucketed = plan_micro_batches(batch, 130, Packing.BUCKETED)
    padded = plan_micro_batches(batch, 130, Packing.PADDED)
    packed = plan_micro_batches(batch, 130, Packing.PACKED)
    cost = {
        name: sum(mb.num_padded_tokens for mb in plan)
        for name, plan in [("bucketed", bucketed), ("padded", padded), ("packed", packed)]
    }
    assert batch.num_tokens <= cost["packed"] < cost["bucketed"] < cost["padded"]
    assert [sorted(mb.seq_indices.tolist()) for mb in bucketed] == [[0, 2, 4], [1, 3, 5]]


def test_select_and_shard(batch):
    part = batch.shard(1, 2)
    assert part.num_sequences == 2
    assert part.completion_ids.shape == (2, 7)
    assert part.completion_lens.tolist() == [2, 7]
    assert torch.equal(part.prompt_ids[1], batch.prompt_ids[3])
    with pytest.raises(ConfigError):
        batch.shard(0, 3)


def test_shared_prefix_computes_a_groups_prompt_once():
    group = group_batch(20, [[1, 2, 3, 4, 5], [1, 2, 7], [9, 8, 7, 6], [1, 2, 3, 4, 6]])
    other = group_batch(6, [[4, 4], [5]], group_id=1)
    batch = TrainBatch.from_trajectories(group + other)
    shared = plan_micro_batches(batch, 1000, Packing.SHARED_PREFIX)
    packed = plan_micro_batches(batch, 1000, Packing.PACKED)
    # Group 0 shares its 20 prompt tokens (its samples part at the first completion token);
    # group 1 its 6: 20 + (5 + 3 + 4 + 5) and 6 + (2 + 1) tokens instead of 4·20 + 17 + 2·6 + 3.
    real = sum(int((mb.input_ids != 0).sum()) for mb in shared)
    assert real == 20 + 17 + 6 + 3
    assert sum(mb.num_padded_tokens for mb in packed) >= batch.num_tokens == 112
    for mb in shared:
        assert_each_token_sees_exactly_its_own_context(batch, mb)


def test_samples_alike_past_the_prompt_share_those_tokens_too():
    sequences = [torch.tensor(t) for t in ([5, 6, 7, 1, 2], [5, 6, 7, 1, 3], [5, 6, 7, 1])]
    assert common_prefix_length(sequences) == 4
    assert common_prefix_length(sequences[:1]) == 5  # a lone sequence is all prefix
    assert common_prefix_length([torch.tensor([1, 2]), torch.tensor([3, 2])]) == 0
    batch = TrainBatch.from_trajectories(group_batch(3, [[1, 2, 9], [1, 2, 8], [1, 2]]))
    (mb,) = plan_micro_batches(batch, 1000, Packing.SHARED_PREFIX)
    assert mb.input_ids.shape == (1, 5 + 1 + 1 + 0)
    assert_each_token_sees_exactly_its_own_context(batch, mb)
    # Tokens 0 and 1 of every sample and token 2's predicting column lie in the prefix.
    assert mb.pred_pos.tolist() == [2, 3, 4, 2, 3, 4, 2, 3]


def test_a_group_longer_than_the_budget_is_split_with_a_prefix_copy_each():
    batch = TrainBatch.from_trajectories(group_batch(10, [[1] * 6, [2] * 5, [3] * 4, [4] * 3]))
    plans = plan_micro_batches(batch, 20, Packing.SHARED_PREFIX)
    assert all(mb.num_padded_tokens <= 20 for mb in plans)
    covered = sorted(int(i) for mb in plans for i in mb.seq_indices)
    assert covered == [0, 1, 2, 3]
    assert len(plans) > 1
    for mb in plans:
        assert_each_token_sees_exactly_its_own_context(batch, mb)
