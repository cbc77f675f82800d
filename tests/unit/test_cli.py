import subprocess
import sys

import pytest

from tir_rl.cli import build_parser, main


def test_help_lists_every_command():
    text = build_parser().format_help()
    for command in ("train", "eval", "rollout", "doctor", "sandbox", "models"):
        assert command in text


def test_console_script_help_runs():
    out = subprocess.run(
        [sys.executable, "-m", "tir_rl.cli", "--help"], capture_output=True, text=True, check=True
    )
    assert "models" in out.stdout


def test_unknown_model_is_a_clear_error(capsys):
    assert main(["models", "prepare", "gpt-17"]) == 2
    assert "Choose 'bundled', 'tiny', 'lab' or 'lab-sft'" in capsys.readouterr().err


def test_lab_options_are_refused_for_other_models(capsys):
    assert main(["models", "prepare", "tiny", "--logit-scale", "0.45"]) == 2
    assert "--logit-scale shape the lab model only" in capsys.readouterr().err


def test_lab_logit_scale_out_of_range_is_refused_before_building(capsys):
    assert main(["models", "prepare", "lab", "--logit-scale", "9"]) == 2
    assert "choose 0.05..4" in capsys.readouterr().err


def test_lab_options_reach_the_model_spec(monkeypatch, tmp_path, capsys):
    from tir_rl import models

    built = []

    def fake_prepare_lab_model(spec=None, dest=None):
        built.append(spec)
        return tmp_path

    monkeypatch.setattr(models, "prepare_lab_model", fake_prepare_lab_model)
    assert main(["models", "prepare", "lab", "--logit-scale", "0.45", "--seed", "3"]) == 0
    assert (built[0].logit_scale, built[0].seed) == (0.45, 3)
    assert capsys.readouterr().out.strip() == str(tmp_path)


def test_missing_required_option_exits_with_usage():
    with pytest.raises(SystemExit):
        main(["doctor"])


def test_train_without_config_or_resume_says_what_to_give(capsys):
    assert main(["train"]) == 2
    assert "--config FILE" in capsys.readouterr().err


def test_lora_on_several_ranks_is_refused_before_torchrun_starts(monkeypatch, capsys):
    from tir_rl import rl_loop as train

    def no_torchrun(*args, **kwargs):
        raise AssertionError("torchrun must not start")

    monkeypatch.setattr(train, "exec_under_torchrun", no_torchrun)
    argv = ["train", "--nproc-per-node", "2", "--config", "configs/quickstart.yaml"]
    assert main([*argv, "--set", "trainer.lora.enabled=true"]) == 2
    assert "trainer.lora.enabled runs on one rank only" in capsys.readouterr().err


def test_sigterm_unwinds_so_finally_blocks_run_and_is_remembered(monkeypatch) -> None:
    import os
    import signal

    from tir_rl.process import termination

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    previous = signal.getsignal(signal.SIGTERM)
    cleaned = []
    try:
        termination.exit_on_sigterm()
        termination.raise_if_terminated()  # nothing came yet
        with pytest.raises(SystemExit) as exc:
            try:
                os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next line
                cleaned.append(False)
            finally:
                cleaned.append(True)
        assert exc.value.code == 128 + signal.SIGTERM
        assert cleaned == [True]  # unwound straight to the finally block
        # a SystemExit swallowed where it landed (a finalizer) is raised again at a safe point
        with pytest.raises(SystemExit):
            termination.raise_if_terminated()
    finally:
        signal.signal(signal.SIGTERM, previous)
        termination.forget()


def test_sigterm_keeps_the_default_under_torchrun(monkeypatch) -> None:
    import signal

    from tir_rl.process import termination

    monkeypatch.setenv("WORLD_SIZE", "2")
    previous = signal.getsignal(signal.SIGTERM)
    termination.exit_on_sigterm()
    assert signal.getsignal(signal.SIGTERM) is previous


class EvalCalled(Exception):
    """Raised by the fake `run_eval` once it has recorded what the command gave it."""


def _fake_run_eval(monkeypatch) -> list:
    """Replace `run_eval` with a fake that records the config and task count, then stops."""
    from tir_rl import evaluate

    calls = []

    def fake_run_eval(config, *, num_tasks, k, samples_per_task=None, report_path=None):
        calls.append((config, num_tasks))
        raise EvalCalled

    monkeypatch.setattr(evaluate, "run_eval", fake_run_eval)
    return calls


def test_eval_without_checkpoint_evaluates_the_configs_model(monkeypatch, capsys):
    calls = _fake_run_eval(monkeypatch)
    with pytest.raises(EvalCalled):
        main(["-v", "eval", "--config", "configs/lab.yaml"])
    config, num_tasks = calls[0]
    assert config.model == "lab"
    assert num_tasks == config.run.eval_tasks
    assert "evaluating lab on tir_rl/MultiHop-v0" in capsys.readouterr().out


def test_eval_accepts_every_named_model_and_the_flags_win_over_the_config(monkeypatch):
    calls = _fake_run_eval(monkeypatch)
    for name in ("lab", "tiny", "bundled"):
        argv = ["-v", "eval", "--config", "configs/lab.yaml", "--checkpoint", name, "--tasks", "3"]
        with pytest.raises(EvalCalled):
            main([*argv, "--split", "train"])
    assert [(c.model, c.env.eval_split, n) for c, n in calls] == [
        ("lab", "train", 3),
        ("tiny", "train", 3),
        ("bundled", "train", 3),
    ]


def test_eval_refuses_a_flag_and_a_set_of_the_same_key(monkeypatch, capsys):
    calls = _fake_run_eval(monkeypatch)
    argv = ["eval", "--config", "configs/lab.yaml", "--checkpoint", "tiny", "--set", "model=lab"]
    assert main(argv) == 2
    assert "--checkpoint and --set model=... both set model" in capsys.readouterr().err
    assert calls == []


def test_eval_refuses_an_unknown_checkpoint_and_says_how_to_use_the_configs_model(capsys):
    assert main(["eval", "--checkpoint", "labb"]) == 2
    assert "Leave --checkpoint out to evaluate the config's `model`" in capsys.readouterr().err
