import asyncio

import pytest
import torch

from tir_rl.engine._loop import LoopThread
from tir_rl.engine.base import (
    FinishReason,
    GenerateRequest,
    ModelInfo,
    StopSequenceMatcher,
    truncate_at_stop_sequence,
)
from tir_rl.engine.parity import probe_parity
from tir_rl.engine.vllm_local import VLLMLocalEngine
from tir_rl.engine.weights.files import write_state_dict
from tir_rl.errors import ConfigError, ParityError


def test_stop_sequence_cut_keeps_the_sequence_and_drops_the_rest():
    ids, lps, seq = truncate_at_stop_sequence(
        [5, 1, 2, 3, 9, 9], [0.0, -1, -2, -3, -4, -5], [[2, 3]]
    )
    assert ids == [5, 1, 2, 3]
    assert lps == [0.0, -1, -2, -3]
    assert seq == (2, 3)


def test_earliest_ending_stop_sequence_wins():
    matcher = StopSequenceMatcher([[1, 2, 3], [2, 3]])
    assert matcher.find([7, 2, 3, 1, 2, 3]) == (3, (2, 3))
    assert matcher.max_len == 3


def test_stop_sequence_search_from_start_finds_sequences_straddling_chunks():
    matcher = StopSequenceMatcher([[4, 5, 6]])
    assert matcher.find([1, 4, 5], start=0) is None
    assert matcher.find([1, 4, 5, 6], start=3) == (4, (4, 5, 6))


def test_no_stop_sequence_leaves_output_untouched():
    assert truncate_at_stop_sequence([1, 2], [-1.0, -2.0], [[2, 1]]) == ([1, 2], [-1.0, -2.0], None)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prompt_token_ids": []},
        {"max_tokens": 0},
        {"temperature": 0.0},
        {"top_p": 0.0},
        {"top_k": 0},
        {"min_p": 1.0},
        {"min_p": -0.1},
        {"stop_token_sequences": [[]]},
    ],
)
def test_invalid_requests_are_config_errors(kwargs):
    with pytest.raises(ConfigError):
        GenerateRequest(**{"prompt_token_ids": [1], "max_tokens": 4, **kwargs}).validate()


def test_local_engine_config_refuses_raw_logprobs_unless_allowed():
    with pytest.raises(ConfigError, match="processed_logprobs"):
        VLLMLocalEngine.Config(model_path="tiny", logprobs_mode="raw_logprobs").validate()
    VLLMLocalEngine.Config(
        model_path="tiny", logprobs_mode="raw_logprobs", allow_other_logprobs_mode=True
    ).validate()


def test_finish_reason_values_match_vllm_strings():
    assert [FinishReason(v) for v in ("stop", "length", "abort")] == [
        FinishReason.STOP,
        FinishReason.LENGTH,
        FinishReason.ABORT,
    ]


def test_weights_file_holds_tied_tensors_separately(tmp_path):
    from safetensors.torch import load_file

    embed = torch.randn(4, 3)
    path = write_state_dict(
        {"embed.weight": embed, "lm_head.weight": embed, "b": torch.ones(2)}, tmp_path
    )
    loaded = load_file(path)
    assert set(loaded) == {"embed.weight", "lm_head.weight", "b"}
    assert torch.equal(loaded["lm_head.weight"], embed)
    assert not list(tmp_path.glob(".*.tmp"))


def test_loop_thread_serves_coroutines_from_several_caller_loops():
    thread = LoopThread("test")
    try:

        async def where():
            return asyncio.get_running_loop()

        assert asyncio.run(thread.run(where())) is thread.loop
        assert asyncio.run(thread.run(where())) is thread.loop
        assert thread.run_sync(where()) is thread.loop
    finally:
        thread.stop()


class FakeEngine:
    """Scores every position with a fixed logprob; enough for the parity logic."""

    def __init__(self, value):
        self.value = value

    @property
    def model_info(self):
        return ModelInfo(
            model_path="fake", dtype="float32", max_model_len=64, logprobs_mode="processed_logprobs"
        )

    async def prompt_logprobs(self, token_ids):
        return [self.value] * (len(token_ids) - 1)


def test_parity_passes_within_tolerance_and_reports_the_gap():
    report = asyncio.run(
        probe_parity(
            FakeEngine(-1.0), lambda ids: [-1.0002] * (len(ids) - 1), [1, 2, 3], tolerance=1e-3
        )
    )
    assert report.passed and report.num_tokens == 2
    assert report.max_abs_diff == pytest.approx(2e-4)


def test_parity_failure_names_the_worst_token_and_the_usual_causes():
    def trainer(ids):
        return [-1.0, -1.5, -1.0]

    with pytest.raises(ParityError, match=r"at token 2.*stale engine weights"):
        asyncio.run(probe_parity(FakeEngine(-1.0), trainer, [1, 2, 3, 4], tolerance=0.1))


def test_parity_rejects_a_trainer_with_the_wrong_length():
    with pytest.raises(ParityError, match="expected 2"):
        asyncio.run(probe_parity(FakeEngine(-1.0), lambda ids: [0.0], [1, 2, 3], tolerance=1.0))
