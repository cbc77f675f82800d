"""End to end on the tiny model: train, checkpoint, resume, eval, doctor (real vLLM, CPU)."""

import asyncio
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import gymnasium
import pytest

from tir_rl.config import load
from tir_rl.doctor import Verdict, run_doctor
from tir_rl.envs.multihop import MultiHopEnv
from tir_rl.errors import TirError
from tir_rl.evaluate import format_table, resolve_checkpoint, run_eval
from tir_rl.models import prepare_tiny_model
from tir_rl.report.run_log import load_trajectories, read_metrics
from tir_rl.report.sequences import SEQUENCES_FILE, read_sequences
from tir_rl.rl_loop import load_resume_config, plan_step, run_train
from tir_rl.rl_loop.step_plan import task_seed
from tir_rl.run_config import RunConfig
from tir_rl.runtime import env_factory, open_runtime, task_specs
from tir_rl.trainer import Trainer
from tir_rl.trainer.checkpoint import latest_checkpoint
from tir_rl.trainer.loss import build_policy_loss

pytestmark = [pytest.mark.vllm, pytest.mark.model]

FAKE_ENV_ID = "tests/FakeParityReward-v0"


class FakeParityRewardEnv(MultiHopEnv):
    """MultiHop prompts, but every turn ends the episode with a reward hashed from its text.

    A random tiny model never answers MultiHop, so every group would be degenerate and the
    gradient zero; this reward differs between samples of a group (unless two texts hash
    alike, ~1/97), so the whole update path runs.
    """

    def step(self, action):
        reward = (sum(map(ord, action.content)) % 97) / 97
        return [], reward, True, False, {}


if FAKE_ENV_ID not in gymnasium.registry:
    gymnasium.register(id=FAKE_ENV_ID, entry_point=FakeParityRewardEnv)

FAILING_ENV_ID = "tests/FakeFailsAfterStartUp-v0"


class FakeFailsAfterStartUpEnv(MultiHopEnv):
    """Resets twice (the run's start-up check builds and resets one per split), then never
    again: every episode of the run fails before it samples a token."""

    resets = 0

    def reset(self, *, seed=None, options=None):
        FakeFailsAfterStartUpEnv.resets += 1
        if FakeFailsAfterStartUpEnv.resets > 2:
            raise RuntimeError("the task server went away")
        return super().reset(seed=seed, options=options)


if FAILING_ENV_ID not in gymnasium.registry:
    gymnasium.register(id=FAILING_ENV_ID, entry_point=FakeFailsAfterStartUpEnv)


LOCAL_ENGINE = ("engine.local.max_model_len=2048", "engine.local.kv_cache_gib=0.25")


def tiny_config(out_dir, *extra, env_id=FAKE_ENV_ID, engine=LOCAL_ENGINE):
    return load(
        RunConfig,
        None,
        [
            "model=tiny",
            f"run.out_dir={out_dir}",
            "run.name=tiny",
            "run.steps=2",
            "run.tasks_per_step=2",
            "run.group_size=2",
            "run.eval_tasks=2",
            f"env.id={env_id}",
            "env.kwargs={horizon: 2}",
            "rollout.max_turns=2",
            "rollout.max_tokens_per_turn=24",
            "rollout.end_on_truncated_turn=false",
            *engine,
            "trainer.lr=1e-3",
            "correction_preset=geo_rs_token_tis",
            "run.plot_every=0",  # drawing the plots is most of a tiny step; two tests read them
            *extra,
        ],
    )


TRAINED = (
    "run.eval_clean_sampler=true",  # without an injection, the run's evaluations count twice
    "run.plot_every=2",  # plots drawn at step 2, the last (a drawing costs about a tiny step)
    "rollout.seed=3",  # seeded and every trained episode saved: the loop composed by hand
    "run.save_trajectories=16",  # must sample and update the same (the last test here)
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return run_train(tiny_config(tmp_path_factory.mktemp("runs"), *TRAINED))


def test_training_writes_readable_run_outputs(trained):
    run_dir = trained.run_dir
    assert trained.steps_done == 2
    before, after = trained.accuracy_before, trained.accuracy_after
    assert before is not None and after is not None
    # the paired change is the mean of the per-task differences: the difference of the means
    change = trained.accuracy_change
    assert change is not None
    assert change.value == pytest.approx(after.value - before.value)
    assert change.low <= change.value <= change.high
    rows = read_metrics(run_dir / "metrics.jsonl")
    train_rows = [r for r in rows if "train/grad_norm" in r]
    assert [r["step"] for r in train_rows] == [1, 2]
    assert any(row["train/grad_norm"] > 0 for row in train_rows)
    for row in train_rows:
        assert row["train/skipped"] == 0.0
        assert "mismatch/k3_kl" in row and "mismatch/turn_0/kl" in row
        # fp32 sampler vs fp32 trainer on the same weights: the parity probe is tight
        assert row["sync/parity_max_abs_diff"] < 1e-3
    assert any("eval/pass_at_1" in r for r in rows)
    saved = load_trajectories(run_dir / "trajectories.jsonl")
    assert saved and all(s.trainer_logprobs is not None for s in saved)
    sequences = read_sequences(run_dir / SEQUENCES_FILE)
    for row in train_rows:  # every trained sequence, with what the correction kept of it
        records = [r for r in sequences if r.step == row["step"]]
        assert all(r.advantage is not None for r in records)
        assert sum(r.kept_tokens or 0 for r in records) == row["train/num_loss_tokens"]
        masked = sum(r.model_tokens - (r.kept_tokens or 0) for r in records)
        assert masked == row["train/num_masked_by_correction"]
    assert (run_dir / "plots" / "reward.png").is_file()
    evaluated = json.loads((run_dir / "eval_step_2.json").read_text())
    assert evaluated["num_tasks"] == 2
    assert evaluated["sampling"] == {"temperature": 1.0, "top_p": 1.0, "top_k": None, "min_p": 0.0}


def test_clean_sampler_eval_without_injection_reuses_the_run_s_evaluation(trained):
    rows = read_metrics(trained.run_dir / "metrics.jsonl")
    own = {r["step"]: r["eval/pass_at_1"] for r in rows if "eval/pass_at_1" in r}
    clean = {r["step"]: r["eval_clean/pass_at_1"] for r in rows if "eval_clean/pass_at_1" in r}
    assert clean == own and sorted(own) == [0, 2]
    report = (trained.run_dir / "eval_step_0.json").read_text()
    assert (trained.run_dir / "eval_clean_step_0.json").read_text() == report


def test_checkpoint_is_a_transformers_model_with_the_trained_weights(trained):
    import torch
    from transformers import AutoModelForCausalLM

    ckpt = latest_checkpoint(trained.run_dir)
    assert ckpt is not None and ckpt.name == "step_2"
    trained_model = AutoModelForCausalLM.from_pretrained(resolve_checkpoint(str(ckpt)))
    initial = AutoModelForCausalLM.from_pretrained(prepare_tiny_model())
    changed = [
        name
        for (name, p), (_, q) in zip(
            trained_model.named_parameters(), initial.named_parameters(), strict=True
        )
        if not torch.equal(p, q)
    ]
    assert changed, "two optimizer steps at lr 1e-3 must change the weights"


def test_a_new_run_refuses_to_overwrite_checkpoints(trained):
    from tir_rl.errors import ConfigError

    with pytest.raises(ConfigError, match="--resume"):
        run_train(tiny_config(trained.run_dir.parent))


def test_eval_and_doctor_on_the_trained_checkpoint(trained, tmp_path):
    model = resolve_checkpoint(str(trained.run_dir))
    config = tiny_config(tmp_path, f"model={model}", env_id="tir_rl/MultiHop-v0")
    # the evaluation samples otherwise than the run trained, and its report says how
    card = tiny_config(tmp_path, f"model={model}", "rollout.temperature=0.6", "rollout.top_k=20",
                       env_id="tir_rl/MultiHop-v0")  # fmt: skip
    report_path = tmp_path / "r.json"
    outcome = run_eval(card, num_tasks=2, k=2, samples_per_task=2, report_path=report_path)
    assert outcome.report.num_tasks == 2 and outcome.report.samples_per_task == 2
    report = json.loads(report_path.read_text())
    assert report["k"] == 2
    assert report["sampling"] == {"temperature": 0.6, "top_p": 1.0, "top_k": 20, "min_p": 0.0}
    assert "sampling: temperature 0.6, top_p 1, top_k 20, min_p 0" in format_table(outcome.report)
    findings = {f.check: f for f in run_doctor(config, num_episodes=2)}
    assert findings["sampler vs trainer logprobs"].verdict is Verdict.PASS
    assert findings["incremental vs full render"].verdict is Verdict.PASS
    assert findings["parity probe (prompt logprobs)"].verdict is Verdict.PASS
    for check in (
        "sampled logprobs",
        "raw vs processed logprobs",
        "lm_head precision (measured)",
        "weight sync",
    ):
        assert findings[check].verdict is Verdict.PASS, findings[check].detail


def test_steps_without_learning_signal_make_no_update_and_the_guard_watches_them(tmp_path):
    # A random tiny model never answers MultiHop: every group has reward 0 (degenerate), so
    # no update ever runs; the mismatch is still measured, and k3 ≥ 0 > −1 alerts the guard.
    config = tiny_config(
        tmp_path, "run.steps=3", "run.eval_tasks=1", "guard.action=stop",
        'guard.absolute={"mismatch/k3_kl": -1.0}', "guard.smooth=1", env_id="tir_rl/MultiHop-v0",
    )  # fmt: skip
    summary = run_train(config)
    assert summary.stopped_by_guard and summary.steps_done == 1
    rows = [r for r in read_metrics(summary.run_dir / "metrics.jsonl") if "train/skipped" in r]
    assert len(rows) == 1 and rows[0]["train/skipped"] == 1.0
    assert rows[0]["train/degenerate_groups"] == 2.0
    assert "mismatch/k3_kl" in rows[0]
    assert "sync/parity_max_abs_diff" not in rows[0]  # no update, so no weight sync
    assert rows[0]["guard/alerts"] == 1.0
    assert (summary.run_dir / "alerts" / "step_000000" / "alert.json").is_file()


def test_a_run_in_which_no_episode_sampled_a_token_fails_with_the_episodes_error(tmp_path):
    FakeFailsAfterStartUpEnv.resets = 0
    config = tiny_config(tmp_path, "run.eval_tasks=1", env_id=FAILING_ENV_ID)
    with pytest.raises(TirError, match="No episode of this run's 2 step") as error:
        run_train(config)
    assert "the task server went away" in str(error.value)


@dataclass(frozen=True)
class ResumedRun:
    """A 1-step KL-penalty run on MultiHop (W&B logging offline when wandb is installed),
    resumed for 2 more steps on rewards that differ within a group."""

    run_dir: Path
    summary: object
    """The resumed run's `TrainSummary`."""
    first_rows: list
    """The metrics rows before the resume."""
    first_state: dict
    """`trainer_state.json` of the first run's checkpoint."""
    wandb_run_id: str | None
    """None when wandb is not installed (the W&B test then skips)."""


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """One run and its resume, read by the KL, W&B and resume tests."""
    out = tmp_path_factory.mktemp("kl")
    # Step 1 on MultiHop: every group is degenerate (reward 0), which a KL run keeps in the
    # update (kl 0 skips such a step). It starts at the reference: KL 0.
    settings = ["loss.kl_coef=0.1", "run.eval_tasks=1", "run.steps=1", "run.plot_every=1"]
    wandb = importlib.util.find_spec("wandb") is not None
    with pytest.MonkeyPatch.context() as patch:
        if wandb:
            for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
                patch.setenv(name, str(out / name.lower()))
            patch.setenv("WANDB_SILENT", "true")
            settings += ["run.loggers=[jsonl,wandb]", "wandb.mode=offline", "wandb.tags=[tiny]"]
        summary = run_train(tiny_config(out, *settings, env_id="tir_rl/MultiHop-v0"))
        run_dir = summary.run_dir
        first_rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "train/skipped" in r]
        first_state = json.loads((latest_checkpoint(run_dir) / "trainer_state.json").read_text())
        run_id = (run_dir / "wandb_run_id").read_text().strip() if wandb else None
        # Resumed on rewards that differ within a group: step 2 moves the policy away from the
        # run's starting weights, and step 3 measures its KL to them (not to the resumed ones).
        # W&B's plots are read from the first run only: the resumed steps draw none
        resume = load_resume_config(
            run_dir, ["run.steps=3", f"env.id={FAKE_ENV_ID}", "run.plot_every=0"]
        )
        resumed_summary = run_train(resume, resume=True)
    return ResumedRun(run_dir, resumed_summary, first_rows, first_state, run_id)


def test_resume_continues_from_the_last_checkpoint(resumed):
    assert resumed.summary.steps_done == 3
    rows = [r for r in read_metrics(resumed.run_dir / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert latest_checkpoint(resumed.run_dir).name == "step_3"


def test_wandb_offline_gets_the_config_rows_and_plots_and_resume_keeps_its_run(
    resumed, monkeypatch
):
    pytest.importorskip("wandb", reason='wandb is not installed (pip install "tir-rl[wandb]")')
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "unit"))
    from wandb_records import history, logged_config, read_records, run_files

    run_dir, run_id = resumed.run_dir, resumed.wandb_run_id
    assert (run_dir / "wandb_run_id").read_text().strip() == run_id
    first, resumed_file = run_files(run_dir)
    assert first.name == resumed_file.name == f"run-{run_id}.wandb"
    records = read_records(first)
    assert logged_config(records)["run"]["name"] == "tiny"
    assert logged_config(records)["wandb"]["tags"] == ["tiny"]
    rows = history(records)
    assert [r["step"] for r in rows if "train/skipped" in r] == ["1"]
    assert any("plots/reward._type" in r for r in rows)
    later = history(read_records(resumed_file))
    assert [r["step"] for r in later if "train/skipped" in r] == ["2", "3"]
    assert not (run_dir / "tensorboard").exists()


def test_a_kl_penalty_run_keeps_degenerate_groups_and_resumes_with_its_reference(resumed):
    rows = resumed.first_rows
    assert rows[0]["train/skipped"] == 0.0 and rows[0]["train/dropped_episodes"] == 0.0
    assert rows[0]["train/degenerate_groups"] == 2.0
    assert rows[0]["train/ref_kl"] == 0.0
    assert resumed.first_state["reference"]["model"] == "tiny"
    assert resumed.first_state["reference"]["path"] == str(prepare_tiny_model())
    rows = [r for r in read_metrics(resumed.run_dir / "metrics.jsonl") if "train/skipped" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["train/skipped"] == 0.0 and rows[2]["train/skipped"] == 0.0
    assert rows[2]["train/ref_kl"] > 0
    assert rows[2]["sync/parity_max_abs_diff"] < 1e-3


def synchronous_reference(config, num_steps: int):
    """The synchronous loop composed by hand from the same parts: play step s's tasks,
    update, send the weights; per step the trajectories in the batch and the update."""
    cfg = config.run
    trainer = Trainer(
        config.trainer, loss_fn=build_policy_loss(config.loss), correction_config=config.correction
    )
    steps = []
    with open_runtime(config) as runtime:
        env = env_factory(config.env, config.env.train_split)
        for step in range(num_steps):
            first = step * cfg.tasks_per_step
            specs = task_specs(
                env,
                num_tasks=cfg.tasks_per_step,
                group_size=cfg.group_size,
                first_group_id=first,
                seed_of=lambda i, first=first: task_seed(cfg.seed, first + i),
            )
            trajectories = runtime.run_episodes(specs)
            plan, (work,) = plan_step(trajectories)
            result = trainer.train_step(work.batch, work.advantages)
            asyncio.run(
                runtime.engine.update_weights(trainer.rank0_full_state_dict(), version=step + 1)
            )
            steps.append(([trajectories[i] for i in plan.in_batch], result))
    return steps


@pytest.mark.slow
def test_the_run_samples_the_same_tokens_and_makes_the_same_update_as_the_loop_by_hand(
    trained, tmp_path
):
    """The run (`run.max_staleness` 0, the default: the producer plays step s's groups only
    after step s - 1's update) against the synchronous loop composed by hand."""
    reference = synchronous_reference(tiny_config(tmp_path, *TRAINED), 2)
    saved = load_trajectories(trained.run_dir / "trajectories.jsonl")
    rows = [r for r in read_metrics(trained.run_dir / "metrics.jsonl") if "train/grad_norm" in r]
    assert len(rows) == 2
    for step, (want_trajectories, want) in enumerate(reference, start=1):
        got = [s.trajectory for s in saved if s.step == step]
        assert [t.completion_ids for t in got] == [t.completion_ids for t in want_trajectories]
        assert [t.group_id for t in got] == [t.group_id for t in want_trajectories]
        assert all(set(t.policy_versions) - {-1} == {step - 1} for t in got)  # on-policy
        row = rows[step - 1]
        assert row["train/loss"] == pytest.approx(want.loss, abs=1e-6)
        assert row["train/grad_norm"] == pytest.approx(want.grad_norm, abs=1e-6)
        assert row["staleness/lag_max"] == 0.0
