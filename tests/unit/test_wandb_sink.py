"""The W&B sink against the real `wandb` package in offline mode (no network).

Offline, W&B writes the run as protobuf `Record`s in a LevelDB-style log,
`<run_dir>/wandb/offline-run-<time>-<id>/run-<id>.wandb`, and images under `files/media/`;
`wandb_records.read_records` reads that log back with wandb's own protobuf classes.
"""

import json
from pathlib import Path

import pytest

wandb = pytest.importorskip(
    "wandb", reason='wandb is not installed (pip install "tir-rl[wandb]", or the dev extra)'
)
from wandb_records import history, logged_config, read_records, run_files  # noqa: E402

from tir_rl.errors import ConfigError  # noqa: E402
from tir_rl.report.metrics_logger import MetricsLogger  # noqa: E402
from tir_rl.report.sinks import LoggerName  # noqa: E402
from tir_rl.report.wandb_sink import RUN_ID_FILE, WandbMode, WandbSink  # noqa: E402


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline, silent, with every folder it writes inside `tmp_path`."""
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(tmp_path / "wandb_dir"),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb_data"),
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return tmp_path


def write_png(path: Path) -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), (200, 30, 30)).save(path)
    return path


def open_logger(run_dir: Path, *, resume_after_step=None, **wandb_settings) -> MetricsLogger:
    config = MetricsLogger.Config(
        run_dir=run_dir,
        loggers=[LoggerName.JSONL, LoggerName.WANDB],
        wandb=WandbSink.Config(mode=WandbMode.OFFLINE, **wandb_settings),
        resume_after_step=resume_after_step,
    )
    return MetricsLogger.open(config)


def test_offline_run_holds_the_config_rows_and_plots(offline):
    run_dir = offline / "runs" / "demo"
    with open_logger(run_dir, tags=["smoke"]) as logger:
        logger.log_config({"run": {"name": "demo", "steps": 2}, "model": "tiny"})
        logger.log(1, {"train/loss": 0.5, "mismatch/kl": float("nan")})
        logger.log(2, {"train/loss": 0.25})
        logger.log(2, {"eval/pass_at_1": 0.75})  # an evaluation shares its step
        logger.log_plots(2, [write_png(run_dir / "plots" / "reward.png")])

    (path,) = run_files(run_dir)
    run_id = (run_dir / RUN_ID_FILE).read_text().strip()
    assert path.name == f"run-{run_id}.wandb"
    records = read_records(path)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.run_id == run_id and run.project == "tir-rl"
    assert run.display_name == "demo" and list(run.tags) == ["smoke"]
    config = logged_config(records)
    assert config["run"] == {"name": "demo", "steps": 2} and config["model"] == "tiny"

    rows = history(records)
    steps_and_loss = [(r["step"], r.get("train/loss")) for r in rows if "train/loss" in r]
    assert steps_and_loss == [("1", "0.5"), ("2", "0.25")]
    assert rows[0]["mismatch/kl"] == "NaN"
    assert [r["step"] for r in rows if "eval/pass_at_1" in r] == ["2"]
    (plot_row,) = [r for r in rows if "plots/reward._type" in r]  # an image is a nested value
    assert plot_row["step"] == "2" and json.loads(plot_row["plots/reward._type"]) == "image-file"
    image = path.parent / "files" / json.loads(plot_row["plots/reward.path"])
    assert image.suffix == ".png" and image.is_file()


def test_resume_continues_the_same_wandb_run(offline):
    run_dir = offline / "runs" / "again"
    with open_logger(run_dir) as logger:
        logger.log(1, {"train/loss": 1.0})
    first_id = (run_dir / RUN_ID_FILE).read_text().strip()
    with open_logger(run_dir, resume_after_step=1) as logger:
        logger.log(2, {"train/loss": 0.5})
    assert (run_dir / RUN_ID_FILE).read_text().strip() == first_id
    files = run_files(run_dir)
    assert [f.name for f in files] == [f"run-{first_id}.wandb"] * 2
    resumed = history(read_records(files[-1]))
    assert [(r["step"], r["train/loss"]) for r in resumed] == [("2", "0.5")]


def test_a_fresh_run_in_the_same_folder_starts_a_new_wandb_run(offline):
    run_dir = offline / "runs" / "fresh"
    with open_logger(run_dir) as logger:
        logger.log(1, {"train/loss": 1.0})
    first_id = (run_dir / RUN_ID_FILE).read_text().strip()
    with open_logger(run_dir, name="renamed") as logger:
        logger.log(1, {"train/loss": 0.5})
    second_id = (run_dir / RUN_ID_FILE).read_text().strip()
    assert second_id != first_id
    by_name = {f.name: f for f in run_files(run_dir)}
    assert set(by_name) == {f"run-{first_id}.wandb", f"run-{second_id}.wandb"}
    records = read_records(by_name[f"run-{second_id}.wandb"])
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "renamed"


def test_a_run_wandb_refuses_to_start_is_a_config_error(offline, monkeypatch):
    def refuse(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(ConfigError, match=r"W&B could not start the run.*wandb login"):
        WandbSink(WandbSink.Config(mode=WandbMode.ONLINE), run_dir=offline)
