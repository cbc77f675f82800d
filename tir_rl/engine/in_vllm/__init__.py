"""Code that runs inside vLLM's own processes (its API server, engine core and workers).

vLLM imports these by dotted name (`worker_extension_cls`, middleware), or they start vLLM:
`serve` (the entry point of the `vllm serve` servers tir-rl starts), `server_guard` (the
per-run secret on every route of a `vllm serve` server, and the check of published weights),
`gloo_receiver` (the worker side of the `gloo` weight transfer), `layer_capture` (the
localizer's hooks in the worker). Nothing here imports tir-rl's run machinery.
"""
