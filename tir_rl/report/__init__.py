"""Reporting: what a run leaves for people and tools to read.

- `metrics_logger`: `MetricsLogger`, which cleans each metrics row and fans it out to the
  run's sinks (`run.loggers`).
- `sinks`: the `MetricsSink` protocol and the JSONL and TensorBoard sinks.
- `wandb_sink`: the optional W&B sink (imports `wandb` only when a run names it).
- `run_log`: reading `metrics.jsonl` back; saved trajectories.
- `step_metrics`: the metrics row of one RL step.
- `eval_stats`: pass@k with bootstrap intervals, the `EvalReport`.
- `plots`: PNG plots from `metrics.jsonl`.
- `viewer`, `viewer_style`: the HTML trajectory viewer.
- `trajectory_text`: trajectories as text and JSONL (`tir-rl rollout`).

Nothing is re-exported here, so importing one module (e.g. `plots`, which loads matplotlib
only when it draws) does not import the others.
"""
