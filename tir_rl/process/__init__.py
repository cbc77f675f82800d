"""Process plumbing: who owns a process, how runs end, torchrun, CPU cores, the run's secret.

- `owner`: which run a process belongs to (engines left by a killed run are found by it);
- `termination`: SIGTERM and Ctrl-C turned into a clean stop with a checkpoint;
- `torchrun`: the command that starts a run's trainer ranks;
- `cpu_cores`: pinning a process to cores, parsing core lists;
- `run_secret`: the per-run secret every server and weight folder of a run demands.
"""
