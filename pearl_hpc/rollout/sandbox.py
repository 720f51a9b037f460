"""Run a model-written Python snippet in an OS sandbox (bubblewrap).

The agent environments execute tool calls (``<python>``, ``<calc>``) that a policy
wrote, dozens at a time from one event loop. Each call is one ``bwrap`` process:

    bwrap --unshare-{pid,net,ipc,uts,cgroup} --die-with-parent --new-session
          --seccomp: no new namespaces, mounts, ptrace, keyring, bpf (:mod:`.seccomp`)
          /usr, the interpreter's prefix: read-only    /proc: its own    /dev: minimal
          /tmp: a private tmpfs (16 MiB), the cwd      /sandbox/snippet.py: read-only
          --clearenv (PATH, HOME, TMPDIR, LC_ALL only)
      python -I -S -c PREAMBLE     (stdlib only; no site-packages)
        PREAMBLE: become uid/gid 65534 with no groups and no capabilities (when bwrap ran
        as root; otherwise a user namespace maps the caller to 65534), set RLIMIT_AS,
        RLIMIT_CPU, RLIMIT_FSIZE (1 MiB), RLIMIT_NPROC 0 (no fork, no thread), no core
        files, few open files; then run the snippet as ``__main__``.

So a snippet sees no host file but the read-only system and interpreter (no /etc, no
/root, no run directory, no key), no other process (its own pid namespace; its pid is
2), no network (an empty network namespace: even 127.0.0.1 refuses), and cannot write
outside its private /tmp. The caller kills the whole tree at the wall-clock timeout or
on a flood of output (bwrap's process group, and the pid namespace with it), drops
output beyond ``max_output_bytes``, and never stalls its event loop on a snippet.

Nothing runs without bubblewrap: :func:`sandbox_problem` says, in one line, what to
install (``apt-get install bubblewrap``) or why it cannot start here, and the ``calc``
environment refuses to start with it. There is no in-process fallback: an audit hook in
the snippet's own interpreter is not a boundary (code can reach it through ``gc``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path

from pearl_hpc.errors import ConfigError
from pearl_hpc.rollout.seccomp import filter_program

SNIPPET_FILE = "snippet.py"  # the snippet's file name (in tracebacks)
SANDBOX_SNIPPET = "/sandbox/snippet.py"  # where the snippet is inside the sandbox
SANDBOX_UID = 65534  # nobody
FILE_SIZE_LIMIT_BYTES = 1 << 20  # RLIMIT_FSIZE: largest file a snippet may write
TMPFS_BYTES = 16 << 20  # the sandbox's /tmp
FLOOD_FACTOR = 64  # output beyond FLOOD_FACTOR * max_output_bytes (>= 1 MiB) kills the child
DRAIN_AFTER_EXIT_S = 1.0  # how long to wait for pipes to close once the child is gone
_READ_CHUNK_BYTES = 1 << 16
INSTALL_HINT = "apt-get install bubblewrap"

# ``python -I -S -c PREAMBLE MEM_BYTES CPU_S FSIZE_BYTES UID SNIPPET NAME`` in the sandbox: drop to
# nobody, set the limits, run the snippet as ``__main__`` (its traceback without the
# preamble's frame). "pearl-sandbox" marks the process for tests.
_PREAMBLE = r"""# pearl-sandbox
import os, resource, sys, traceback

_mem, _cpu, _fsize, _uid = (int(a) for a in sys.argv[1:5])
_path, _name = sys.argv[5], sys.argv[6]
if os.getuid() == 0:  # bwrap ran as root: nobody, no groups (capabilities go with uid 0)
    os.setgroups([])
    os.setgid(_uid)
    os.setuid(_uid)

def _limit(kind, soft, hard):
    _, cap = resource.getrlimit(kind)
    if cap != resource.RLIM_INFINITY:
        soft, hard = min(soft, cap), min(hard, cap)
    resource.setrlimit(kind, (soft, hard))

_limit(resource.RLIMIT_AS, _mem, _mem)
_limit(resource.RLIMIT_CPU, _cpu, _cpu + 1)  # SIGXCPU at the soft limit, SIGKILL at the hard
_limit(resource.RLIMIT_FSIZE, _fsize, _fsize)
_limit(resource.RLIMIT_NPROC, 0, 0)  # no fork, no thread (uid nobody)
_limit(resource.RLIMIT_CORE, 0, 0)
_limit(resource.RLIMIT_NOFILE, 64, 64)
with open(_path, encoding="utf-8") as _f:
    _source = _f.read()
sys.dont_write_bytecode = True
sys.argv = [_name]
__builtins__.exit = __builtins__.quit = sys.exit  # -S skips site, which defines them
try:
    exec(compile(_source, _name, "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as _e:
    traceback.print_exception(type(_e), _e, _e.__traceback__.tb_next)
    raise SystemExit(1) from None
"""


class SandboxUnavailable(ConfigError):
    """bubblewrap is missing or cannot build a sandbox on this machine."""


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """What one snippet may use; every limit is enforced in the child or by the caller."""

    timeout_s: float = 2.0  # wall clock; the whole process group is killed after it
    cpu_s: int = 2  # RLIMIT_CPU: CPU seconds before SIGXCPU, SIGKILL one second later
    memory_mb: int = 256  # RLIMIT_AS: address space; python itself needs ~20 MB of it
    max_output_bytes: int = 4096  # stdout and stderr are each truncated to this

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            integral = f.name != "timeout_s"
            kind = int if integral else int | float
            if isinstance(value, bool) or not isinstance(value, kind):
                noun = "an integer" if integral else "a number"
                raise ConfigError(
                    f"SandboxLimits.{f.name} must be {noun}, got {value!r}; "
                    f"e.g. the default {f.default!r}"
                )
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(
                    f"SandboxLimits.{f.name} must be positive and finite, got {value!r}; "
                    f"e.g. the default {f.default!r}"
                )
        if self.memory_mb < 32:
            raise ConfigError(
                f"SandboxLimits.memory_mb={self.memory_mb} is too small for python itself to "
                "start; use at least 32"
            )


DEFAULT_LIMITS = SandboxLimits()


@dataclass(frozen=True, slots=True)
class SandboxResult:
    """What a snippet did. Output past the limit ends with a ``[... truncated]`` line."""

    stdout: str  # decoded UTF-8 (invalid bytes replaced), at most max_output_bytes + a note
    stderr: str  # the snippet's traceback, or a note from the sandbox (timeout, flood)
    exit_code: int | None  # negative: killed by that signal; None if it could not start
    # (a snippet exiting with 128 + N reads as killed by signal N, as bwrap reports it)
    timed_out: bool  # killed after limits.timeout_s of wall clock
    wall_s: float  # from start to the child's exit, as seen by the caller

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


def _system_mounts() -> list[str]:
    """/usr read-only; /bin, /lib, /lib64, /sbin as they are here (links into /usr on
    Debian 12, directories elsewhere)."""
    argv = ["--ro-bind", "/usr", "/usr"]
    for name in ("/bin", "/lib", "/lib64", "/sbin"):
        if os.path.islink(name):
            argv += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            argv += ["--ro-bind", name, name]
    return argv


def _interpreter_mounts(prefix: str) -> list[str]:
    """The interpreter's prefix read-only at its own path; the folders above it made
    traversable (bwrap creates them 0700)."""
    if prefix == "/usr" or prefix.startswith("/usr/"):
        return []
    argv = []
    for parent in reversed(Path(prefix).parents[:-1]):  # /root, /root/.pyenv, ...
        argv += ["--perms", "0755", "--dir", str(parent)]
    return [*argv, "--ro-bind", prefix, prefix]


def build_argv(
    limits: SandboxLimits,
    snippet: str,
    seccomp_fd: int,
    *,
    python: str = sys.executable,
    bwrap: str = "bwrap",
) -> list[str]:
    """The sandbox's command line (pure but for reading this machine's root links);
    ``snippet``: the host file bound read-only at :data:`SANDBOX_SNIPPET`;
    ``seccomp_fd``: an open file of :func:`~.seccomp.filter_program`."""
    argv = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"]
    argv += ["--unshare-cgroup-try", "--die-with-parent", "--new-session"]
    argv += ["--seccomp", str(seccomp_fd)]
    if os.getuid() != 0:  # unprivileged: a user namespace maps the caller to nobody
        argv += ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
    argv += _system_mounts() + _interpreter_mounts(sys.base_prefix)
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--perms", "1777", "--size", str(TMPFS_BYTES), "--tmpfs", "/tmp"]
    argv += ["--perms", "0755", "--dir", os.path.dirname(SANDBOX_SNIPPET)]
    argv += ["--ro-bind", snippet, SANDBOX_SNIPPET, "--chdir", "/tmp", "--clearenv"]
    for key, value in SANDBOX_ENV.items():
        argv += ["--setenv", key, value]
    argv += ["--", os.path.realpath(python), "-I", "-S", "-c", _PREAMBLE]
    argv += [str(limits.memory_mb << 20), str(limits.cpu_s), str(FILE_SIZE_LIMIT_BYTES)]
    return [*argv, str(SANDBOX_UID), SANDBOX_SNIPPET, SNIPPET_FILE]


def _seccomp_fd(workdir: str) -> int:
    """An open file of the seccomp filter, for ``bwrap --seccomp`` (the caller closes it)."""
    path = os.path.join(workdir, "seccomp.bpf")
    Path(path).write_bytes(filter_program())
    return os.open(path, os.O_RDONLY)


SANDBOX_ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": "/tmp", "TMPDIR": "/tmp"}


@functools.cache
def sandbox_problem() -> str | None:
    """Why snippets cannot run here (one line), or None; probed once."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return f"the tool sandbox needs bubblewrap (bwrap), not found on PATH: {INSTALL_HINT}"
    with tempfile.TemporaryDirectory(prefix="pearl-sandbox-") as workdir:
        snippet = _write_snippet(workdir, "print(6 * 7)\n")
        try:
            fd = _seccomp_fd(workdir)
        except ValueError as exc:
            return f"the tool sandbox cannot filter system calls here: {exc}"
        try:
            probe = subprocess.run(
                build_argv(SandboxLimits(), snippet, fd, bwrap=bwrap),
                capture_output=True, text=True, timeout=30, env=SANDBOX_ENV, check=False,
                pass_fds=(fd,),
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"bubblewrap could not start a sandbox here: {exc}"
        finally:
            os.close(fd)
    if probe.returncode != 0 or probe.stdout != "42\n":
        said = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return (
            f"bubblewrap could not start a sandbox here ({said}); it needs root or "
            "unprivileged user namespaces: sysctl user.max_user_namespaces=15000 "
            "(RHEL-family), kernel.unprivileged_userns_clone=1 (Debian), "
            "kernel.apparmor_restrict_unprivileged_userns=0 (Ubuntu 24.04)"
        )
    return None


def require_sandbox() -> None:
    """Refuse (one line, :class:`SandboxUnavailable`) where snippets cannot run."""
    problem = sandbox_problem()
    if problem is not None:
        raise SandboxUnavailable(problem)


async def run_python(code: str, limits: SandboxLimits = DEFAULT_LIMITS) -> SandboxResult:
    """Run ``code`` in a fresh sandbox and report what it printed.

    Never raises for anything the snippet does (errors, timeouts, floods are in the
    result); :class:`SandboxUnavailable` where no sandbox can run. Cancelling the caller
    kills the sandbox and removes its directory.

    The sandbox runs on an event loop of its own, in a thread (one a process): its
    process start (a fork and exec, the child watcher's thread) and its directory's
    removal held the caller's loop for 4-8 ms a snippet, and the master's loop runs every
    trajectory's tool calls (thousands a step at PEARL's scale).
    """
    require_sandbox()
    future = asyncio.run_coroutine_threadsafe(_run_python(code, limits), _sandbox_loop())
    return await asyncio.wrap_future(future)  # (cancelled: the sandbox's task too)


_LOOPS: dict[int, asyncio.AbstractEventLoop] = {}  # pid -> its sandboxes' loop
_LOOP_LOCK = threading.Lock()


def _sandbox_loop() -> asyncio.AbstractEventLoop:
    """This process's sandbox loop, started at its first snippet (a forked child, whose
    copy of its parent's loop has no thread, starts its own)."""
    with _LOOP_LOCK:
        loop = _LOOPS.get(os.getpid())
        if loop is None:
            loop = _LOOPS[os.getpid()] = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="sandboxes", daemon=True).start()
        return loop


async def _run_python(code: str, limits: SandboxLimits) -> SandboxResult:
    workdir = tempfile.mkdtemp(prefix="pearl-sandbox-")
    started_s = time.perf_counter()
    try:
        snippet = _write_snippet(workdir, code)
        fd = _seccomp_fd(workdir)
        try:
            proc = await asyncio.create_subprocess_exec(
                *build_argv(limits, snippet, fd, bwrap=shutil.which("bwrap") or "bwrap"),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=SANDBOX_ENV,
                start_new_session=True,  # its own process group, killed as a whole
                pass_fds=(fd,),
            )
        except OSError as e:
            elapsed_s = time.perf_counter() - started_s
            return SandboxResult("", f"sandbox: could not start: {e}", None, False, elapsed_s)
        finally:
            os.close(fd)
        try:
            return await _supervise(proc, limits, started_s)
        finally:
            if proc.returncode is None:  # cancelled: leave nothing behind
                _kill_group(proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _write_snippet(workdir: str, code: str) -> str:
    """``code`` in ``workdir`` (0700: no other user reaches it), readable by the
    sandbox's uid nobody, whatever the process's umask (a run's is 077)."""
    path = os.path.join(workdir, SNIPPET_FILE)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.fchmod(fd, 0o644)  # before a byte is in it
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(code)
    return path


class _Capture:
    """Keeps the first ``keep_bytes`` of a stream and counts the rest."""

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self.data = bytearray()
        self.total_bytes = 0

    def add(self, chunk: bytes) -> None:
        room = self.keep_bytes - len(self.data)
        if room > 0:
            self.data += chunk[:room]
        self.total_bytes += len(chunk)

    def text(self) -> str:
        text = self.data.decode("utf-8", errors="replace")
        dropped = self.total_bytes - len(self.data)
        if dropped > 0:
            text += f"\n[... {dropped} more bytes truncated]"
        return text


async def _supervise(
    proc: asyncio.subprocess.Process, limits: SandboxLimits, started_s: float
) -> SandboxResult:
    assert proc.stdout is not None and proc.stderr is not None
    flood_bytes = max(FLOOD_FACTOR * limits.max_output_bytes, 1 << 20)
    out, err = _Capture(limits.max_output_bytes), _Capture(limits.max_output_bytes)
    flooded = asyncio.Event()
    drains = [
        asyncio.create_task(_drain(proc.stdout, out, flood_bytes, flooded)),
        asyncio.create_task(_drain(proc.stderr, err, flood_bytes, flooded)),
    ]
    exited = asyncio.create_task(proc.wait())
    flood = asyncio.create_task(flooded.wait())
    try:
        await asyncio.wait(
            {exited, flood}, timeout=limits.timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        timed_out = not exited.done() and not flooded.is_set()
        _kill_group(proc.pid)  # also ends anything the snippet left running
        exit_code = await exited
        if exit_code is not None and 128 < exit_code < 128 + 65:
            exit_code = 128 - exit_code  # bwrap's 128 + N: the snippet died of signal N
        wall_s = time.perf_counter() - started_s
        _, pending = await asyncio.wait(drains, timeout=DRAIN_AFTER_EXIT_S)
    finally:
        for task in (*drains, exited, flood):
            task.cancel()
    stderr = err.text()
    if timed_out:
        stderr += f"\n[sandbox: killed after the {limits.timeout_s:g} s timeout]"
    if flooded.is_set():
        stderr += f"\n[sandbox: killed after more than {flood_bytes} bytes of output]"
    if pending:
        stderr += "\n[sandbox: output pipes stayed open after exit; output may be incomplete]"
    return SandboxResult(out.text(), stderr.lstrip("\n"), exit_code, timed_out, wall_s)


async def _drain(
    stream: asyncio.StreamReader, capture: _Capture, flood_bytes: int, flooded: asyncio.Event
) -> None:
    """Read to EOF, so the child never blocks on a full pipe; flag a flood of output."""
    while chunk := await stream.read(_READ_CHUNK_BYTES):
        capture.add(chunk)
        if capture.total_bytes > flood_bytes:
            flooded.set()


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
