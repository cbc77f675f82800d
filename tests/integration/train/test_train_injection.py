"""The train loop with mismatch injection: injected sampler weights, stale syncs, no raise.

One run serves both tests: 3 steps under logit noise 0.3 with the weights synced every 2
updates, evaluated after every step with the run's own sampler and with a clean one.
"""

import pytest
from test_train_tiny import tiny_config

from tir_rl.report.run_log import read_metrics
from tir_rl.rl_loop import run_train

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module")
def injected(tmp_path_factory):
    config = tiny_config(
        tmp_path_factory.mktemp("runs"),
        "run.steps=3",
        "run.eval_every=1",
        "run.eval_clean_sampler=true",
        "inject.logit_noise_std=0.3",
        "inject.sync_every=2",
        # geo_rs's band rejects every token under this noise: then no update, hence no sync
        "correction_preset=token_tis",
    )
    summary = run_train(config)
    return summary, read_metrics(summary.run_dir / "metrics.jsonl")


def test_noise_injection_is_measured_not_raised_and_stale_steps_skip_the_sync(injected):
    summary, all_rows = injected
    assert summary.steps_done == 3
    rows = [r for r in all_rows if "train/grad_norm" in r]
    # Steps 1 and 3 apply the 1st and 3rd update: no sync (stale); step 2: sync + probe.
    synced = [r["step"] for r in rows if "sync/parity_max_abs_diff" in r]
    assert synced == [2]
    # The probe compares the noisy sampler with the trainer: a gap well above fp32 noise.
    assert rows[1]["sync/parity_max_abs_diff"] > 1e-2
    # The trainer measured that mismatch on the rollouts too.
    assert all(r["mismatch/k3_kl"] > 1e-5 for r in rows)
    assert all("guard/alerts" in r for r in rows)


def test_clean_sampler_eval_runs_the_trainer_weights_then_gives_the_sampler_back(injected):
    summary, rows = injected
    clean = [r["step"] for r in rows if "eval_clean/pass_at_1" in r]
    own = [r["step"] for r in rows if "eval/pass_at_1" in r]
    assert clean == own == [0, 1, 2, 3]
    for step in clean:
        assert (summary.run_dir / f"eval_clean_step_{step}.json").is_file()
    # Each clean evaluation hands the injected (step 0) or stale (steps 1, 3) sampler back:
    # had the engine kept the trainer's weights, the next rollouts would measure no mismatch.
    trained = [r for r in rows if "mismatch/k3_kl" in r]
    assert [r["step"] for r in trained] == [1, 2, 3]
    assert all(r["mismatch/k3_kl"] > 1e-5 for r in trained)
