r"""`SymbolicChecker`: is a model's answer mathematically equal to the reference (math-verify)?

`math-verify <https://github.com/huggingface/Math-Verify>`_ parses both sides (LaTeX or
plain: ``\sqrt{2}``, ``2^{1/2}``, ``\frac{\pi}{3}``, ``π/3``, ``0.75``, ``1,234``, ``x = 3``,
sets, intervals) into sympy and compares them. A bare answer is wrapped in ``$...$`` first,
as math-verify reads LaTeX only between delimiters.

Why a helper process: sympy can take unbounded time and memory on a hostile answer (the
model writes ``<answer>9^{9^{9^{9}}}</answer>``: evaluating it never returns), math-verify's
own timeout uses ``signal.alarm`` (main thread only; environments step in worker threads),
and a C-level big-integer power cannot be interrupted by a signal anyway. So every check
runs in one long-lived ``python -c`` child that imports only math-verify; a check that
overruns `timeout_s` is scored unequal and the child is killed and restarted on the next
check. The child starts on the first check (about a second: sympy), never at import.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import select
import subprocess
import sys
import threading

from tir_rl.errors import SetupError

logger = logging.getLogger(__name__)

_WORKER = r"""
import json, logging, sys
logging.disable(logging.WARNING)  # math-verify warns once that its own timeout is off
from math_verify import parse, verify

def read(text):
    wrapped = text if ("$" in text or "\\boxed" in text) else "$" + text + "$"
    return parse(wrapped, parsing_timeout=None)

# The first parse and verify load sympy's and the LaTeX grammar's lazy parts (seconds on a
# loaded machine): pay that before "ready", so that `timeout_s` measures comparisons only.
verify(read("\\frac{\\pi}{3}"), read("\\pi/3 + 0.5"), timeout_seconds=None)
print("ready", flush=True)
for line in sys.stdin:
    request = json.loads(line)
    try:
        gold, answer = read(request["reference"]), read(request["answer"])
        equal = bool(gold) and bool(answer) and verify(gold, answer, timeout_seconds=None)
    except Exception:
        equal = False
    print("1" if equal else "0", flush=True)
"""

START_TIMEOUT_S = 120.0
"""How long the child may take to import math-verify (sympy) on a loaded machine."""


class SymbolicChecker:
    """Compares answers with math-verify in a helper process; thread-safe."""

    def __init__(self, *, timeout_s: float = 5.0) -> None:
        """Prepare the checker; the helper process starts on the first check.

        Args:
            timeout_s: the longest one comparison may take; a slower one counts as unequal.
        """
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None

    def equal(self, answer: str, reference: str) -> bool:
        """Whether `answer` and `reference` denote the same mathematical object.

        Raises:
            SetupError: math-verify is not installed, or its helper process cannot start.
        """
        request = json.dumps({"answer": answer, "reference": reference}) + "\n"
        with self._lock:
            proc = self._send(request)
            reply = self._read_line(proc, self.timeout_s)
            if reply is None:
                logger.warning(
                    "math-verify took over %.0f s on answer %.80r; scored 0 (helper restarted)",
                    self.timeout_s,
                    answer,
                )
                self._stop()
                return False
            return reply == "1"

    def _send(self, request: str) -> subprocess.Popen[str]:
        """Write `request` to the helper, restarting it once if it died since the last one."""
        for attempt in (1, 2):
            proc = self._started()
            assert proc.stdin is not None
            try:
                proc.stdin.write(request)
                proc.stdin.flush()
                return proc
            except (BrokenPipeError, OSError):
                self._stop()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Stop the helper process; a later check starts a new one. Idempotent."""
        with self._lock:
            self._stop()

    def _started(self) -> subprocess.Popen[str]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        if importlib.util.find_spec("math_verify") is None:
            raise SetupError(
                "answer checking with math-verify needs the math-verify package: "
                "pip install math-verify (a tir-rl dependency; reinstall tir-rl)"
            )
        proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        if self._read_line(proc, START_TIMEOUT_S) != "ready":
            proc.kill()
            proc.wait()
            raise SetupError(
                f"the math-verify helper process did not start within {START_TIMEOUT_S:.0f} s "
                f"(run `{sys.executable} -c 'import math_verify'` to see why)"
            )
        self._proc = proc
        return proc

    @staticmethod
    def _read_line(proc: subprocess.Popen[str], timeout_s: float) -> str | None:
        """The child's next output line, or None if none came within `timeout_s`."""
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        if not ready:
            return None
        line = proc.stdout.readline()
        return line.strip() if line else None

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()


_shared: SymbolicChecker | None = None
_shared_lock = threading.Lock()


def shared_checker() -> SymbolicChecker:
    """The process's one checker (its helper is stopped when the process exits)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = SymbolicChecker()
            atexit.register(_shared.close)
        return _shared
