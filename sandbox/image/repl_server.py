"""The in-sandbox REPL server: one persistent Python interpreter per episode.

It runs *inside* the sandbox (container or bubblewrap), started as
``python3 -I -c <this file's source> <config JSON>``, so the host's copy is always the one
that runs and the image only needs a Python. It must only use the standard library.

Protocol: one JSON object per line on fd 0 (requests) and fd 1 (responses); nothing else is
ever written to the protocol stream. At start the server moves the protocol to private
descriptors, points fd 0 at /dev/null and fds 1 and 2 at pipes drained by reader threads, so
anything the cell writes (``print``, ``os.write(1, ...)``, child processes) is captured, capped
and can never corrupt the protocol.

Requests:
    {"op": "ping"}
    {"op": "run", "code": str, "timeout_s": float}
    {"op": "call", "source": str, "name": str, "arguments": {...}, "timeout_s": float}

Response (always one line): {"stdout", "stderr", "result", "error", "timed_out", "value_json"}.

The soft timeout here (an interval timer raising inside Python code) keeps the interpreter's
state when it works; the host enforces a hard deadline on top by killing the sandbox, which
also covers C code that never returns to the interpreter.
"""

import ast
import builtins
import json
import linecache
import os
import signal
import sys
import threading
import traceback

PROTOCOL_VERSION = 1
MAIN_PID = os.getpid()
# Bound now, so user code that replaces json.dumps, os.write or builtins cannot break replies.
_dumps, _loads, _os_write, _repr = json.dumps, json.loads, os.write, repr


class CellTimeout(BaseException):
    """Raised inside the cell by the soft timer (a BaseException so bare excepts miss it less)."""


def _clean(text):
    """Make text valid UTF-8: lone surrogates become backslash escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _cap(text, limit, what):
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[... truncated: {len(text) - limit} more characters of {what} ...]"


class _Capture:
    """Drain one pipe in a thread, keeping at most `limit` bytes per cell.

    A cell's output ends where a random marker, written through a private descriptor at the
    end of the cell, comes out of the pipe: everything before it was written during the cell.
    """

    MARK_LEN = 24

    def __init__(self, fd_target, limit, name):
        self.limit = limit
        self.name = name
        self.lock = threading.Condition()
        self.chunks = []
        self.kept = 0
        self.dropped = 0
        self.waiting = None
        self.seen = None
        read_fd, write_fd = os.pipe()  # both non-inheritable
        os.dup2(write_fd, fd_target)  # fd_target stays inheritable for child processes
        self.mark_fd = write_fd
        self.read_fd = read_fd
        threading.Thread(target=self._drain, daemon=True).start()

    def _take(self, data):
        room = self.limit - self.kept
        if room > 0:
            self.chunks.append(data[:room])
            self.kept += min(room, len(data))
        self.dropped += max(0, len(data) - max(room, 0))

    def _drain(self):
        carry = b""
        while True:
            try:
                chunk = os.read(self.read_fd, 1 << 16)
            except OSError:
                return
            if not chunk:
                return
            data = carry + chunk
            with self.lock:
                token = self.waiting
                if token is not None and token in data:
                    before, data = data.split(token, 1)
                    self._take(before)
                    self.seen, self.waiting = token, None
                    self.lock.notify_all()
                keep = self.MARK_LEN - 1
                self._take(data[:-keep] if len(data) > keep else b"")
                carry = data[-keep:] if len(data) > keep else data

    def collect(self):
        """Return this cell's text (with a truncation marker) and reset for the next cell."""
        token = b"\x00\x1b" + os.urandom(11).hex().encode()
        assert len(token) == self.MARK_LEN
        with self.lock:
            self.waiting, self.seen = token, None
        try:
            os.write(self.mark_fd, token)
            with self.lock:
                self.lock.wait_for(lambda: self.seen == token, timeout=2.0)
        except OSError:
            pass
        with self.lock:
            self.waiting = None
            text = b"".join(self.chunks).decode("utf-8", "replace")
            if self.dropped:
                text += f"\n[... truncated: {self.dropped} more bytes of {self.name} ...]"
            self.chunks, self.kept, self.dropped = [], 0, 0
        return text


_ARMED = [False]


def _on_timer(signum, frame):
    if _ARMED[0]:
        _ARMED[0] = False
        raise CellTimeout()


def _user_traceback(exc):
    """Format `exc` keeping only frames of the user's cells and shipped functions."""
    te = traceback.TracebackException.from_exception(exc, limit=None)
    stack = [f for f in te.stack if f.filename.startswith(("<cell-", "<tool-"))]
    te.stack = traceback.StackSummary.from_list(stack)
    # Chained exceptions keep their own (untrimmed) stacks; trim them the same way.
    for chained in (te.__cause__, te.__context__):
        if chained is not None:
            chained.stack = traceback.StackSummary.from_list(
                [f for f in chained.stack if f.filename.startswith(("<cell-", "<tool-"))]
            )
    return "".join(te.format())


class Server:
    """Runs cells in a persistent namespace and answers requests."""

    def __init__(self, config):
        self.max_output = int(config.get("max_output_bytes", 16384))
        self.namespace = {"__name__": "__main__", "__builtins__": builtins}
        self.tool_namespace = {"__name__": "__tools__", "__builtins__": builtins}
        self.cell_index = 0
        self.proto_in = os.fdopen(os.dup(0), "rb", buffering=0)
        self.proto_out = os.fdopen(os.dup(1), "wb", buffering=0)
        self.proto_fd = self.proto_out.fileno()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        self.out = _Capture(1, self.max_output, "stdout")
        self.err = _Capture(2, self.max_output, "stderr")
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - lives as long as the process
        sys.stdout = open(1, "w", closefd=False, errors="backslashreplace", buffering=1)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False, errors="backslashreplace", buffering=1)  # noqa: SIM115
        os.register_at_fork(after_in_child=self._after_fork)
        signal.signal(signal.SIGALRM, _on_timer)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # too-large writes raise OSError instead
        for name in config.get("preload", []):
            __import__(name)

    def _after_fork(self):
        # A forked child must never answer on the protocol stream.
        for stream in (self.proto_in, self.proto_out):
            try:
                os.close(stream.fileno())
            except OSError:
                pass

    def serve(self):
        """Answer requests until the host closes the protocol stream."""
        buf = b""
        while True:
            chunk = self.proto_in.read(1 << 16)
            if not chunk:
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    response = self._handle(_loads(line))
                except Exception as exc:  # noqa: BLE001 - a bad request must not kill the server
                    response = {"error": f"bad request: {exc!r}"}
                self._send(response)

    def _send(self, response):
        data = (_dumps(response, ensure_ascii=True) + "\n").encode("ascii")
        view = memoryview(data)
        while view:
            view = view[_os_write(self.proto_fd, view) :]

    def _handle(self, request):
        op = request.get("op")
        if op == "ping":
            return {"pong": PROTOCOL_VERSION, "pid": os.getpid()}
        if op == "run":
            return self._run_cell(request["code"], float(request["timeout_s"]))
        if op == "call":
            return self._call(request, float(request["timeout_s"]))
        return {"error": f"unknown request {op!r}"}

    def _timed(self, work, timeout_s):
        """Run `work()` under the soft timer; return (value, error, timed_out)."""
        value = error = None
        timed_out = False
        try:
            try:
                _ARMED[0] = True
                signal.setitimer(signal.ITIMER_REAL, max(timeout_s, 0.001))
                value = work()
            finally:
                _ARMED[0] = False
                signal.setitimer(signal.ITIMER_REAL, 0)
        except CellTimeout:
            timed_out = True
            error = f"TimeoutError: the code ran longer than {timeout_s:g} s and was interrupted."
        except SystemExit as exc:
            error = f"SystemExit: {exc.code!r} (exit() is ignored; the interpreter keeps running)"
        except BaseException as exc:  # noqa: BLE001 - every user error becomes a message
            error = _user_traceback(exc)
        finally:
            if os.getpid() != MAIN_PID:  # a forked child fell out of the user's code
                os._exit(0)
        return value, error, timed_out

    def _compile_cell(self, code):
        self.cell_index += 1
        filename = f"<cell-{self.cell_index}>"
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        tree = ast.parse(code, filename, "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        body = compile(tree, filename, "exec")
        tail = compile(last, filename, "eval") if last is not None else None
        return body, tail

    def _run_cell(self, code, timeout_s):
        def work():
            body, tail = self._compile_cell(code)
            exec(body, self.namespace)
            if tail is not None:
                value = eval(tail, self.namespace)
                if value is not None:
                    self.namespace["_"] = value
                    return _cap(_repr(value), self.max_output, "the result")
            return None

        result, error, timed_out = self._timed(work, timeout_s)
        return self._response(result=result, error=error, timed_out=timed_out)

    def _call(self, request, timeout_s):
        name = request["name"]

        def work():
            filename = f"<tool-{name}>"
            source = request["source"]
            linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
            exec(compile(source, filename, "exec"), self.tool_namespace)
            fn = self.tool_namespace.get(name)
            if not callable(fn):
                raise NameError(f"the shipped source does not define a function {name!r}")
            value = fn(**request["arguments"])
            try:
                return json.dumps(value, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise TypeError(
                    f"{name}() returned a value that is not JSON: {type(value).__name__} ({exc})"
                ) from None

        value_json, error, timed_out = self._timed(work, timeout_s)
        return self._response(value_json=value_json, error=error, timed_out=timed_out)

    def _response(self, **fields):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a broken stream must not kill the server
                pass
        response = {"stdout": self.out.collect(), "stderr": self.err.collect()}
        for key, value in fields.items():
            response[key] = _clean(value) if isinstance(value, str) else value
        if response.get("error"):
            response["error"] = _cap(response["error"], self.max_output, "the traceback")
        return response


def main():
    """Start the server with the JSON config given as the first argument."""
    config = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    sys.setrecursionlimit(int(config.get("recursion_limit", 3000)))
    Server(config).serve()


if __name__ == "__main__":
    main()
