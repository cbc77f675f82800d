"""Reporting: what a run leaves for people and tools to read.

- `run_log`: the metrics sinks (`metrics.jsonl`, TensorBoard) and saved trajectories.
- `step_metrics`: the metrics row of one RL step.
- `eval_stats`: pass@k with bootstrap intervals, the `EvalReport`.
- `plots`: PNG plots from `metrics.jsonl`.
- `viewer`, `viewer_style`: the HTML trajectory viewer.
- `trajectory_text`: trajectories as text and JSONL (`tir-rl rollout`).

Nothing is re-exported here, so importing one module (e.g. `plots`, which loads matplotlib
only when it draws) does not import the others.
"""
