"""What reaches the terminal: tir-rl's own progress, warnings and summary.

vLLM, transformers and torch log freely: vLLM's engine and worker processes print their
configuration, thread binding and kernel choices (about sixty lines to start a tiny model),
torch's C++ side prints warnings straight to the file descriptors, and Python warnings come
from every library. `send_library_output_to(path)` sends all of that to one file, for this
process and for the processes it starts, and leaves the terminal to the `tir_rl` loggers
(INFO and up) and to anyone's errors. The CLI does this unless `--verbose`.

How each source is routed:

- Python logging in this process: the terminal handler keeps `tir_rl` records and ERROR or
  worse from anyone; a file handler takes every record. Python warnings become log records
  (`py.warnings`), so they reach the file only.
- vLLM's loggers, in this process and in its engine processes: vLLM reads a logging
  configuration from `VLLM_LOGGING_CONFIG_PATH` when it is imported; it is set to send them
  to the file.
- transformers' handler and progress bars: its records propagate to the file handler; its
  bars (and the Hugging Face hub's) are off.
- Everything else a child process writes (torch's C++ warnings, a worker's prints): its
  standard output and error are the file, because `child_output()` points this process's
  descriptors 1 and 2 at the file while an engine starts its processes, then points them
  back.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

_library_log: Path | None = None
"""Where library output goes; None: nothing is routed (the terminal gets everything)."""

_TIR_RL = "tir_rl"
_PACKAGE_DIR = str(Path(__file__).resolve().parent)


class TerminalFilter(logging.Filter):
    """Pass tir-rl's records (its Python warnings too), and ERROR or worse from any logger."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether the record belongs on the terminal."""
        own = record.name == _TIR_RL or record.name.startswith(_TIR_RL + ".")
        # A captured warning names the file that raised it (or its caller's, by stacklevel).
        own_warning = record.name == "py.warnings" and _PACKAGE_DIR in record.getMessage()
        return own or own_warning or record.levelno >= logging.ERROR


def send_library_output_to(path: Path) -> None:
    """Route library output of this process and of the processes it starts to `path`.

    Call before vLLM is imported (its logging configuration is read at import); the CLI does,
    before it starts a command. Appends to `path`, so a resumed run keeps one file. The routing
    lasts for the process (vLLM keeps the configuration it read): it is for a process that runs
    one command, not for a library caller or a test process (`tir-rl -v` skips it).
    """
    global _library_log
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    file_handler = logging.FileHandler(path, encoding="utf-8")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for handler in root.handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(
            handler, logging.FileHandler
        ):
            handler.addFilter(TerminalFilter())
    root.addHandler(file_handler)
    logging.captureWarnings(True)
    _route_vllm_logging(path)
    _quiet_transformers()
    _library_log = path


def _route_vllm_logging(path: Path) -> None:
    """Point vLLM's logging configuration, read by every process that imports it, at `path`."""
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "vllm": {"format": "%(asctime)s %(levelname)s %(name)s [pid %(process)d]: %(message)s"}
        },
        "handlers": {
            "file": {
                "class": "logging.FileHandler",
                "filename": str(path),
                "formatter": "vllm",
                "encoding": "utf-8",
            }
        },
        "loggers": {"vllm": {"handlers": ["file"], "level": "INFO", "propagate": False}},
    }
    handle, name = tempfile.mkstemp(prefix="tir-rl-vllm-logging-", suffix=".json")
    with os.fdopen(handle, "w") as file:
        json.dump(config, file)
    config_path = Path(name)
    atexit.register(_remove_quietly, config_path)
    os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(config_path)


def _remove_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def _quiet_transformers() -> None:
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_default_handler()
    transformers_logging.enable_propagation()
    transformers_logging.disable_progress_bar()


@contextlib.contextmanager
def child_output() -> Iterator[None]:
    """While open, processes started by this one write their output to the library log.

    Points file descriptors 1 and 2 at the log and back on exit; whatever this process writes
    to them meanwhile goes there too. A no-op when library output is not routed.
    """
    if _library_log is None:
        yield
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    saved = [os.dup(1), os.dup(2)]
    log_fd = os.open(_library_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, log_fd):
            os.close(fd)
