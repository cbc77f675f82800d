"""The terminal keeps tir-rl's output; library logs and child processes' output go to a file.

Run in a fresh interpreter each: routing changes the process's logging, environment and file
descriptors, which must not leak into other tests.
"""

import logging
import subprocess
import sys
import textwrap

from tir_rl.console import TerminalFilter

SCRIPT = textwrap.dedent(
    """
    import logging, subprocess, sys, warnings
    from pathlib import Path
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from tir_rl import console
    if sys.argv[2] == "route":
        console.send_library_output_to(Path(sys.argv[1]))
    logging.getLogger("tir_rl.rl_loop").info("step 1 done")
    logging.getLogger("vllm.engine").info("Initializing a V1 LLM engine")
    logging.getLogger("vllm.engine").error("EngineCore died")
    logging.getLogger("transformers.modeling_utils").warning("weights not initialized")
    warnings.warn("reduce_op is deprecated", FutureWarning)
    # as tir-rl's own modules raise one (the file that raised it is in the package)
    warnings.warn_explicit("skipping malformed metrics line", UserWarning,
                           filename=console.__file__, lineno=1)
    with console.child_output():
        child = subprocess.Popen([sys.executable, "-c",
            "import sys; print('worker hello'); print('NUMA binding', file=sys.stderr)"])
    child.wait()
    print("summary line")
    """
)


def run(tmp_path, mode: str) -> tuple[str, str]:
    log = tmp_path / "libraries.log"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(log), mode], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr, log.read_text() if log.exists() else ""


def test_routed_output_leaves_tir_rl_and_errors_on_the_terminal(tmp_path):
    terminal, log = run(tmp_path, "route")
    assert "step 1 done" in terminal and "summary line" in terminal
    assert "EngineCore died" in terminal  # an error shows, from any library
    assert "skipping malformed metrics line" in terminal  # tir-rl's own Python warning
    for line in ("Initializing a V1", "weights not initialized", "reduce_op", "worker hello",
                 "NUMA binding"):  # fmt: skip
        assert line not in terminal, line
        assert line in log, line


def test_without_routing_everything_reaches_the_terminal(tmp_path):
    terminal, log = run(tmp_path, "plain")
    for line in ("step 1 done", "Initializing a V1", "worker hello", "NUMA binding"):
        assert line in terminal, line
    assert log == ""


def test_the_terminal_filter_keeps_tir_rl_and_errors():
    def record(name: str, level: int) -> logging.LogRecord:
        return logging.LogRecord(name, level, __file__, 1, "m", None, None)

    keep = TerminalFilter().filter
    assert keep(record("tir_rl", logging.INFO)) and keep(record("tir_rl.engine", logging.DEBUG))
    assert not keep(record("vllm", logging.WARNING))
    assert not keep(record("tir_rl_other", logging.INFO))  # another package, not a child
    assert keep(record("torch", logging.ERROR))
