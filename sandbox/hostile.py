"""The hostile-input suite: code a model (or an attacker) might send, and what must happen.

Every case must be *contained* (the call returns within its deadline plus grace, the host is
unaffected), produce a *clear tool message*, and leave the pool *healthy*: after each case a
brand-new episode runs a canary that checks it starts clean (empty ``/tmp``, unprivileged
user, working interpreter). Used by ``tir-rl sandbox check`` and by the integration tests.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tir_rl.sandbox.base import ExecResult, Sandbox

OpenEpisode = Callable[[], contextlib.AbstractContextManager[Sandbox]]


class CaseFailed(AssertionError):
    """A hostile case was not contained as required."""


@dataclass
class HostContext:
    """Host-side bait: a secret in the trainer's environment and files, a listening port."""

    open_episode: OpenEpisode
    secret: str = field(default_factory=lambda: secrets.token_hex(16))
    grace_s: float = 2.0
    """The backend's hard-deadline grace: a call may take its timeout plus this."""
    port: int = 0
    secret_file: str = ""

    @contextlib.contextmanager
    def baited(self) -> Iterator[HostContext]:
        """Plant the secret in os.environ and a file, and listen on the host's loopback."""
        os.environ["TIR_RL_HOSTILE_SECRET"] = self.secret
        path = f"/tmp/tir-rl-hostile-{os.getpid()}"
        with open(path, "w") as f:
            f.write(self.secret)
        self.secret_file = path
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("0.0.0.0", 0))
        server.listen(16)
        server.settimeout(0.2)
        self.port = server.getsockname()[1]
        stop = threading.Event()

        def serve() -> None:
            while not stop.is_set():
                try:
                    conn, _ = server.accept()
                except OSError:
                    continue
                with conn:
                    conn.sendall(self.secret.encode())

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join(timeout=2)
            server.close()
            os.environ.pop("TIR_RL_HOSTILE_SECRET", None)
            with contextlib.suppress(OSError):
                os.unlink(path)


@dataclass(frozen=True)
class HostileCase:
    """One hostile input and its check; `check` raises CaseFailed and returns the message."""

    name: str
    description: str
    check: Callable[[HostContext], str]
    slow: bool = False


@dataclass(frozen=True)
class CaseReport:
    """Outcome of one case."""

    name: str
    passed: bool
    message: str
    """The tool message the model would have seen (first line), or why the case failed."""
    duration_s: float


# ----------------------------------------------------------------- helpers


def _expect(condition: bool, what: str, result: ExecResult | None = None) -> None:
    if not condition:
        seen = "" if result is None else f" (got: {_summary(result)!r})"
        raise CaseFailed(what + seen)


def _summary(r: ExecResult) -> str:
    text = r.error or r.result or r.stdout or r.stderr or "(no output)"
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return (lines[-1] if r.error and lines else (lines[0] if lines else text))[:160]


def _bounded(ctx: HostContext, r: ExecResult, timeout_s: float) -> None:
    _expect(r.duration_s <= timeout_s + ctx.grace_s + 5.0,
            f"took {r.duration_s:.1f} s, past its deadline", r)


def _run(ctx: HostContext, code: str, timeout_s: float = 5.0) -> ExecResult:
    with ctx.open_episode() as sb:
        r = sb.run(code, timeout_s=timeout_s)
    _bounded(ctx, r, timeout_s)
    return r


def canary(ctx: HostContext) -> None:
    """A fresh episode must start clean: empty /tmp, unprivileged, working interpreter."""
    with ctx.open_episode() as sb:
        r = sb.run("import os\n(os.getuid() != 0, sorted(os.listdir('/tmp')), 6 * 7)",
                   timeout_s=10)
    _expect(r.ok and r.result == "(True, [], 42)", "the next episode did not start clean", r)


# ------------------------------------------------------------------- cases


def _fork_bomb(ctx: HostContext) -> str:
    r = _run(ctx, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                  "        pass", timeout_s=2)
    _expect(not r.ok, "a fork bomb cannot succeed", r)
    return _summary(r)


def _memory_hog(ctx: HostContext) -> str:
    r = _run(ctx, "blocks = [bytearray(64 * 1024**2) for _ in range(200)]", timeout_s=20)
    _expect(not r.ok and "memory" in (r.error or "").lower(), "expected a memory message", r)
    return _summary(r)


def _python_loop(ctx: HostContext) -> str:
    with ctx.open_episode() as sb:
        sb.run("kept = 7", timeout_s=5)
        r = sb.run("while True:\n    pass", timeout_s=1)
        after = sb.run("kept", timeout_s=5)
    _bounded(ctx, r, 1)
    _expect(r.timed_out and "TimeoutError" in (r.error or ""), "expected a timeout", r)
    _expect(after.ok and (after.result == "7" or r.state_lost), "episode unusable after", after)
    return _summary(r)


def _c_loop(ctx: HostContext) -> str:
    with ctx.open_episode() as sb:
        r = sb.run("sum(range(10**12))", timeout_s=1)
        after = sb.run("6 * 7", timeout_s=5)
    _bounded(ctx, r, 1)
    _expect(r.timed_out and r.state_lost, "a C loop must be killed from outside", r)
    _expect(after.ok and after.result == "42", "the episode must go on in a fresh interpreter",
            after)
    return _summary(r)


def _stdout_flood(ctx: HostContext) -> str:
    r = _run(ctx, "import os, sys\nline = 'x' * (1 << 20)\nfor _ in range(1024):\n"
                  "    print(line)\nfor _ in range(1024):\n    os.write(1, line.encode())",
             timeout_s=15)
    _expect(len(r.stdout) < 256 * 1024, f"stdout not capped ({len(r.stdout)} chars)", r)
    _expect(r.timed_out or "truncated" in r.stdout, "no visible truncation marker", r)
    return f"{len(r.stdout)} chars kept, then: " + (r.stdout.strip().splitlines() or [""])[-1][:100]


def _write_outside_tmp(ctx: HostContext) -> str:
    code = (
        "refused = []\n"
        "for path in ['/x', '/etc/passwd', '/usr/lib/evil.py', '/home/sandbox/x', '/proc/x',\n"
        "             '/bin/sh', '/usr/local/lib/python3.11/dist-packages/numpy/__init__.py']:\n"
        "    try:\n"
        "        open(path, 'a').write('pwned')\n"
        "    except OSError:\n"
        "        refused.append(path)\n"
        "len(refused)"
    )
    r = _run(ctx, code)
    _expect(r.ok and r.result == "7", "some write outside /tmp succeeded", r)
    return "all 7 writes outside /tmp refused"


def _fill_tmp(ctx: HostContext) -> str:
    code = ("chunk = b'0' * (1 << 20)\nfor i in range(100000):\n"
            "    with open(f'/tmp/fill{i % 50}', 'ab') as f:\n        f.write(chunk)")
    r = _run(ctx, code, timeout_s=20)
    _expect(not r.ok and ("No space" in (r.error or "") or "too large" in (r.error or "")),
            "filling /tmp must stop at its size limit", r)
    return _summary(r)


def _network(ctx: HostContext) -> str:
    code = (
        "import socket\nreached = []\n"
        f"for host in ['127.0.0.1', '172.17.0.1', '10.0.2.2', '8.8.8.8', {_host_ip()!r}]:\n"
        "    try:\n"
        f"        s = socket.create_connection((host, {ctx.port}), timeout=0.5)\n"
        "        reached.append((host, s.recv(64)))\n"
        "    except OSError:\n"
        "        pass\n"
        "try:\n    socket.getaddrinfo('example.com', 80)\n    reached.append('dns')\n"
        "except OSError:\n    pass\n"
        "ifaces = [l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]]\n"
        "(reached, ifaces)"
    )
    r = _run(ctx, code, timeout_s=10)
    _expect(r.ok and r.result == "([], ['lo'])", "network reachable from the sandbox", r)
    _expect(ctx.secret not in (r.result or ""), "reached the host's loopback listener", r)
    return "no route anywhere (only 'lo'); host listener unreachable"


def _trainer_secrets(ctx: HostContext) -> str:
    code = (
        "import os, glob\nfound = []\n"
        "found += [k for k in os.environ if 'SECRET' in k]\n"
        f"for p in [{ctx.secret_file!r}, '/proc/1/environ', '/etc/shadow', '/root/.ssh',\n"
        "          '/work', '/var/run/docker.sock', '/run/docker.sock']:\n"
        "    try:\n        found.append((p, open(p, 'rb').read(4096)))\n"
        "    except OSError:\n        pass\n"
        "for p in glob.glob('/proc/[0-9]*/environ'):\n"
        "    try:\n        found.append((p, open(p, 'rb').read()))\n"
        "    except OSError:\n        pass\n"
        "found"
    )
    r = _run(ctx, code)
    _expect(r.ok, "probe failed to run", r)
    _expect(ctx.secret not in (r.result or "") + r.stdout, "the trainer's secret leaked", r)
    _expect("TIR_RL_HOSTILE_SECRET" not in (r.result or ""), "the trainer's env leaked", r)
    return "trainer env vars and files invisible"


def _kill_interpreter(ctx: HostContext) -> str:
    with ctx.open_episode() as sb:
        r = sb.run("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", timeout_s=5)
        after = sb.run("6 * 7", timeout_s=5)
    _expect(r.state_lost and "InterpreterDied" in (r.error or ""), "expected a death notice", r)
    _expect(after.result == "42", "the episode must go on in a fresh interpreter", after)
    return _summary(r)


def _corrupt_interpreter(ctx: HostContext) -> str:
    code = ("import os, json, builtins\njson.dumps = json.loads = None\nbuiltins.repr = None\n"
            "for fd in range(3, 64):\n    try:\n        os.write(fd, b'{garbage\\n')\n"
            "    except OSError:\n        pass")
    with ctx.open_episode() as sb:
        r = sb.run(code, timeout_s=5)
        after = sb.run("6 * 7", timeout_s=5)
    _bounded(ctx, r, 5)
    _expect(after.ok or after.state_lost, "the episode must recover", after)
    return _summary(r)


def _os_exit(ctx: HostContext) -> str:
    r = _run(ctx, "import os\nos._exit(0)")
    _expect(r.state_lost and "exited" in (r.error or ""), "expected an exit notice", r)
    return _summary(r)


def _segfault(ctx: HostContext) -> str:
    r = _run(ctx, "import ctypes\nctypes.string_at(0)")
    _expect(r.state_lost and "SIGSEGV" in (r.error or ""), "expected a segfault notice", r)
    return _summary(r)


def _background_process(ctx: HostContext) -> str:
    marker = "tirrl-bg-" + secrets.token_hex(6)
    code = (
        "import subprocess, sys\n"
        f"src = 'import time\\nwhile True:\\n    time.sleep(0.05)  # {marker}'\n"
        "subprocess.Popen([sys.executable, '-c', src], start_new_session=True)\n"
        "subprocess.Popen(['/bin/sh', '-c', "
        f"'python3 -c \"import time; time.sleep(1000)  # {marker}\" &'])\n"
        "'started'"
    )
    with ctx.open_episode() as sb:
        r = sb.run(code, timeout_s=5)
        _expect(r.ok and r.duration_s < 3.0, "a background process must not hold the cell", r)
        _expect(_host_processes_with(marker) > 0, "the background process did not start", r)
    deadline = time.monotonic() + 10
    while _host_processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    _expect(_host_processes_with(marker) == 0, "a background process outlived its episode")
    return f"cell returned in {r.duration_s:.2f} s; processes gone after the episode"


def _invalid_utf8(ctx: HostContext) -> str:
    r = _run(ctx, "import os, sys\nos.write(1, b'bad \\xff\\xfe \\xc3\\x28\\n')\n"
                  "sys.stdout.buffer.write(b'\\x80\\x81\\n')\nprint('\\udcff')\n'\\udcff'")
    _expect(r.ok, "invalid UTF-8 output must not fail the call", r)
    for text in (r.stdout, r.result or "", r.stderr):
        text.encode("utf-8")  # raises on lone surrogates
    _expect("bad" in r.stdout and "\ufffd" in r.stdout, "output lost", r)
    return "bytes replaced, output valid UTF-8"


def _concurrent(n: int) -> Callable[[HostContext], str]:
    def check(ctx: HostContext) -> str:
        def episode(i: int) -> bool:
            with ctx.open_episode() as sb:
                a = sb.run(f"import os\nmine = {i}\nopen('/tmp/mine', 'w').write(str(mine))",
                           timeout_s=60)
                b = sb.run("mine * 2, open('/tmp/mine').read(), len(os.listdir('/tmp'))",
                           timeout_s=60)
            return a.ok and b.result == f"({2 * i}, '{i}', 1)"

        with ThreadPoolExecutor(n) as workers:
            ok = list(workers.map(episode, range(n)))
        _expect(all(ok), f"{ok.count(False)} of {n} concurrent episodes failed or saw others")
        return f"{n} episodes, each saw only its own state"

    return check


def _host_proc(ctx: HostContext) -> str:
    code = ("import os\nprocs = [p for p in os.listdir('/proc') if p.isdigit()]\n"
            "cmds = [open(f'/proc/{p}/cmdline', 'rb').read() for p in procs]\n"
            "host = (b'dockerd', b'containerd', b'pytest', b'sshd')\n"
            "(len(procs), any(w in c for c in cmds for w in host))")
    r = _run(ctx, code)
    _expect(r.ok and r.result is not None and r.result.endswith("False)"),
            "host processes visible from the sandbox", r)
    count = int((r.result or "(0").strip("()").split(",")[0])
    _expect(count < 10, f"{count} processes visible: host pid namespace shared?", r)
    return f"only {count} sandbox processes visible in /proc"


def _privilege_escalation(ctx: HostContext) -> str:
    code = (
        "import os\nerrors = []\n"
        "for f in (lambda: os.setuid(0), lambda: os.setgid(0), lambda: os.chroot('/tmp'),\n"
        "          lambda: os.mknod('/tmp/dev', 0o600 | 0o020000, os.makedev(1, 3))):\n"
        "    try:\n        f()\n    except OSError:\n        errors.append(1)\n"
        "cap = [l for l in open('/proc/self/status') if l.startswith('CapEff')][0].split()[1]\n"
        "(os.getuid(), len(errors), int(cap, 16))"
    )
    r = _run(ctx, code)
    _expect(r.ok and r.result is not None and r.result.endswith(", 4, 0)")
            and not r.result.startswith("(0,"), "privilege escalation possible", r)
    return "setuid/setgid/chroot/mknod refused; no capabilities"


def _huge_payload(ctx: HostContext) -> str:
    big = "x = '" + "a" * (8 << 20) + "'"
    with ctx.open_episode() as sb:
        r = sb.run(big, timeout_s=5)
        args = sb.call_function("def f(s):\n    return len(s)", "f", {"s": "a" * (8 << 20)},
                                timeout_s=5)
    _expect(not r.ok and "limit" in (r.error or ""), "a huge payload must be refused", r)
    _expect(not args.ok, "huge arguments must be refused", args)
    return _summary(r)


def _deep_recursion(ctx: HostContext) -> str:
    with ctx.open_episode() as sb:
        r = sb.run("def f(n):\n    return f(n + 1)\nf(0)", timeout_s=5)
        deep = sb.run("import sys\nsys.setrecursionlimit(10**7)\ndef g(n):\n    return g(n + 1)\n"
                      "g(0)", timeout_s=5)
        nested = sb.run("eval('[' * 100000 + ']' * 100000)", timeout_s=5)
        after = sb.run("6 * 7", timeout_s=5)
    _expect("RecursionError" in (r.error or ""), "expected a RecursionError", r)
    _expect(not deep.ok, "unbounded recursion must fail", deep)
    _expect(not nested.ok, "absurd nesting must fail", nested)
    _expect(after.result == "42", "episode unusable after deep recursion", after)
    return _summary(r)


def _resource_exhaustion(ctx: HostContext) -> str:
    code = ("import threading, time\nthreads = []\ntry:\n    for _ in range(100000):\n"
            "        t = threading.Thread(target=time.sleep, args=(30,), daemon=True)\n"
            "        t.start()\n        threads.append(t)\nexcept RuntimeError as e:\n"
            "    err = str(e)\nfiles = []\ntry:\n    for i in range(100000):\n"
            "        files.append(open('/dev/null'))\nexcept OSError as e:\n    ferr = str(e)\n"
            "(len(threads) < 1000, len(files) < 10000)")
    r = _run(ctx, code, timeout_s=10)
    _expect(not r.ok or r.result == "(True, True)", "thread/file limits not enforced", r)
    return _summary(r) if not r.ok else "thread and file-descriptor limits hit and reported"


def _slow_repr(ctx: HostContext) -> str:
    r = _run(ctx, "class A:\n    def __repr__(self):\n        while True:\n            pass\nA()",
             timeout_s=1)
    _expect(r.timed_out, "a hanging __repr__ must time out", r)
    return _summary(r)


CASES: tuple[HostileCase, ...] = (
    HostileCase("fork_bomb", "processes forking forever", _fork_bomb),
    HostileCase("memory_hog", "allocating far past the memory limit", _memory_hog),
    HostileCase("python_loop", "infinite Python loop (soft timeout keeps state)", _python_loop),
    HostileCase("c_loop", "C-level loop that ignores signals (hard kill)", _c_loop),
    HostileCase("stdout_flood", "2 GiB to stdout (print and os.write)", _stdout_flood),
    HostileCase("write_outside_tmp", "writing to /, /etc, /usr, site-packages", _write_outside_tmp),
    HostileCase("fill_tmp", "filling /tmp", _fill_tmp),
    HostileCase("network", "connecting out, to the host's loopback, DNS", _network),
    HostileCase("trainer_secrets", "reading the trainer's env vars and files", _trainer_secrets),
    HostileCase("kill_interpreter", "SIGKILL to the interpreter itself", _kill_interpreter),
    HostileCase("corrupt_interpreter", "breaking json/builtins, writing to the protocol fds",
                _corrupt_interpreter),
    HostileCase("os_exit", "os._exit(0)", _os_exit),
    HostileCase("segfault", "segmentation fault through ctypes", _segfault),
    HostileCase("background_process", "detached processes meant to outlive the cell",
                _background_process),
    HostileCase("invalid_utf8", "invalid UTF-8 and lone surrogates on stdout", _invalid_utf8),
    HostileCase("host_proc", "looking for host processes in /proc", _host_proc),
    HostileCase("privilege_escalation", "setuid, chroot, mknod, capabilities",
                _privilege_escalation),
    HostileCase("huge_payload", "8 MiB of code and of arguments", _huge_payload),
    HostileCase("deep_recursion", "deep recursion, raised recursion limit, deep nesting",
                _deep_recursion),
    HostileCase("resource_exhaustion", "thousands of threads and open files",
                _resource_exhaustion),
    HostileCase("slow_repr", "a result whose repr never returns", _slow_repr),
    HostileCase("concurrent_16", "16 concurrent episodes with private state", _concurrent(16)),
    HostileCase("concurrent_64", "64 concurrent episodes with private state", _concurrent(64),
                slow=True),
)


def run_case(case: HostileCase, ctx: HostContext) -> CaseReport:
    """Run one case and then the canary; never raises for a failed case."""
    began = time.monotonic()
    try:
        message = case.check(ctx)
        canary(ctx)
        passed = True
    except CaseFailed as exc:
        message, passed = str(exc), False
    except Exception as exc:  # noqa: BLE001 - an infrastructure error fails the case, visibly
        message, passed = f"{type(exc).__name__}: {exc}", False
    return CaseReport(case.name, passed, message, time.monotonic() - began)


def run_suite(
    open_episode: OpenEpisode,
    *,
    grace_s: float = 2.0,
    include_slow: bool = False,
    names: list[str] | None = None,
    on_report: Callable[[CaseReport], None] | None = None,
) -> list[CaseReport]:
    """Run the suite (optionally only `names`) against `open_episode`; return the reports."""
    cases = [c for c in CASES if (include_slow or not c.slow) and (not names or c.name in names)]
    reports = []
    with HostContext(open_episode, grace_s=grace_s).baited() as ctx:
        for case in cases:
            report = run_case(case, ctx)
            reports.append(report)
            if on_report is not None:
                on_report(report)
    return reports


def format_table(reports: list[CaseReport]) -> str:
    """A plain-text pass/fail table."""
    width = max((len(r.name) for r in reports), default=4)
    lines = [f"{'case':<{width}}  result  time    message", "-" * (width + 60)]
    for r in reports:
        status = "pass" if r.passed else "FAIL"
        lines.append(f"{r.name:<{width}}  {status:<6}  {r.duration_s:5.1f}s  {r.message}")
    passed = sum(r.passed for r in reports)
    lines.append(f"{passed}/{len(reports)} passed")
    return "\n".join(lines)


def _host_ip() -> str:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _host_processes_with(marker: str) -> int:
    count = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    count += 1
        except OSError:
            pass
    return count
