"""Run a model-written Python snippet in a contained child process.

The agent environments execute tool calls (``<python>``, ``<calc>``) that a policy
wrote, dozens at a time from one event loop. Each call gets:

- a fresh ``python -I -S`` child (isolated mode, no site-packages: stdlib only), started
  with ``asyncio.create_subprocess_exec`` in its own session, stdin closed, an almost
  empty environment and a fresh temporary directory as cwd (removed afterwards);
- resource limits set by a small preamble before the snippet runs: ``RLIMIT_AS``
  (memory), ``RLIMIT_CPU``, ``RLIMIT_FSIZE`` (1 MiB), ``RLIMIT_NPROC`` 0 (no fork for a
  non-root user), no core files, few open files;
- no network: a private network namespace (``unshare --net``, only a down loopback
  inside) when this machine allows it, probed once; in every case the preamble also
  installs an audit hook that refuses ``socket.*`` events;
- a wall-clock timeout after which the whole process group is killed; output beyond
  ``max_output_bytes`` is dropped and a flood of output ends the child early, so a
  snippet never stalls the caller's event loop.

The audit hook also refuses fork/exec/kill, ``ctypes``, raising resource limits and
writes outside the temporary directory. That stops the accidents a model-written
snippet makes (``rm -rf``, a fork loop) even when the caller runs as root; it is not a
security boundary against deliberately hostile code, which needs a container.
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
import time
from dataclasses import dataclass, fields

from pearl_hpc.errors import ConfigError

SNIPPET_FILE = "snippet.py"  # the snippet's file name inside the temporary directory
FILE_SIZE_LIMIT_BYTES = 1 << 20  # RLIMIT_FSIZE: largest file a snippet may write
FLOOD_FACTOR = 64  # output beyond FLOOD_FACTOR * max_output_bytes (>= 1 MiB) kills the child
DRAIN_AFTER_EXIT_S = 1.0  # how long to wait for pipes to close once the child is gone
_READ_CHUNK_BYTES = 1 << 16

# The preamble runs as ``python -I -S -c PREAMBLE SNIPPET MEM_BYTES CPU_S FSIZE_BYTES``. It
# sets the limits, installs the audit hook and runs the snippet as ``__main__``, printing
# the snippet's traceback without the preamble's frame.
_PREAMBLE = r"""
import os, resource, sys, traceback

def _limit(kind, soft, hard):
    _, cap = resource.getrlimit(kind)
    if cap != resource.RLIM_INFINITY:
        soft, hard = min(soft, cap), min(hard, cap)
    resource.setrlimit(kind, (soft, hard))

_path, _mem, _cpu, _fsize = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
_limit(resource.RLIMIT_AS, _mem, _mem)
_limit(resource.RLIMIT_CPU, _cpu, _cpu + 1)  # SIGXCPU at the soft limit, SIGKILL at the hard
_limit(resource.RLIMIT_FSIZE, _fsize, _fsize)
_limit(resource.RLIMIT_NPROC, 0, 0)  # no fork for a non-root user (root ignores it)
_limit(resource.RLIMIT_CORE, 0, 0)
_limit(resource.RLIMIT_NOFILE, 64, 64)
with open(_path, encoding="utf-8") as _f:
    _source = _f.read()
sys.dont_write_bytecode = True

def _install_hook(root, realpath=os.path.realpath, join=os.path.join, fspath=os.fspath,
                  PermissionError=PermissionError, isinstance=isinstance):
    refused = ("socket.", "ctypes.")
    refused_exact = frozenset((
        "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
        "subprocess.Popen", "os.kill", "os.killpg", "signal.pthread_kill",
        "resource.setrlimit", "resource.prlimit"))
    path_args = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1),
                 "os.link": (0, 1), "os.symlink": (1,), "os.chmod": (0,), "os.chown": (0,),
                 "os.truncate": (0,), "os.utime": (0,), "shutil.rmtree": (0,)}
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    prefix = join(root, "")

    def outside(path):
        if not isinstance(path, (str, bytes, os.PathLike)):
            return False  # a file descriptor: the open that made it was checked
        path = fspath(path)
        if isinstance(path, bytes):
            path = path.decode("utf-8", "surrogateescape")
        resolved = realpath(join(root, path))
        return resolved != root and not resolved.startswith(prefix)

    def hook(event, args):
        if event.startswith(refused) or event in refused_exact:
            raise PermissionError(f"{event} is not allowed in the sandbox")
        if event == "import" and args[0] == "_posixsubprocess":
            raise PermissionError("subprocesses are not allowed in the sandbox")
        if event == "open" and args[2] and args[2] & write_flags and outside(args[0]):
            raise PermissionError(f"writing {args[0]!r} is not allowed in the sandbox")
        for i in path_args.get(event, ()):
            if len(args) > i and outside(args[i]):
                raise PermissionError(f"{event} on {args[i]!r} is not allowed in the sandbox")

    sys.addaudithook(hook)

_install_hook(os.getcwd())
sys.argv = [_path]
__builtins__.exit = __builtins__.quit = sys.exit  # -S skips site, which defines them
try:
    exec(compile(_source, _path, "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as _e:
    traceback.print_exception(type(_e), _e, _e.__traceback__.tb_next)
    raise SystemExit(1) from None
"""


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
    timed_out: bool  # killed after limits.timeout_s of wall clock
    wall_s: float  # from start to the child's exit, as seen by the caller

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@functools.cache
def network_isolation() -> str:
    """``"netns"`` when ``unshare --net`` works here (probed once), else ``"audit-hook"``.

    A network namespace needs CAP_SYS_ADMIN (root, or a user namespace); on a machine
    without it the audit hook, which is always installed, is the only guard.
    """
    unshare = shutil.which("unshare")
    if unshare is None:
        return "audit-hook"
    try:
        probe = subprocess.run(
            [unshare, "--net", "--", "true"], capture_output=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return "audit-hook"
    return "netns" if probe.returncode == 0 else "audit-hook"


def build_argv(limits: SandboxLimits, *, netns: bool, python: str = sys.executable) -> list[str]:
    """The child's command line; the snippet is read from ``SNIPPET_FILE`` in its cwd."""
    argv = [python, "-I", "-S", "-c", _PREAMBLE, SNIPPET_FILE]
    argv += [str(limits.memory_mb << 20), str(limits.cpu_s), str(FILE_SIZE_LIMIT_BYTES)]
    if netns:
        unshare = shutil.which("unshare") or "unshare"
        argv = [unshare, "--net", "--", *argv]
    return argv


def child_env(workdir: str) -> dict[str, str]:
    """A minimal environment: nothing of the caller's (tokens, proxies, CUDA settings)."""
    return {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}


async def run_python(code: str, limits: SandboxLimits = DEFAULT_LIMITS) -> SandboxResult:
    """Run ``code`` in a fresh sandboxed interpreter and report what it printed.

    Never raises for anything the snippet does (errors, timeouts, floods are in the
    result); cancelling the caller kills the child and removes its directory.
    """
    return await _run(code, limits, netns=network_isolation() == "netns")


async def _run(code: str, limits: SandboxLimits, *, netns: bool) -> SandboxResult:
    workdir = tempfile.mkdtemp(prefix="pearl-sandbox-")
    started_s = time.perf_counter()
    try:
        with open(os.path.join(workdir, SNIPPET_FILE), "w", encoding="utf-8") as f:
            f.write(code)
        try:
            proc = await asyncio.create_subprocess_exec(
                *build_argv(limits, netns=netns),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=workdir,
                env=child_env(workdir),
                start_new_session=True,  # its own process group, killed as a whole
            )
        except OSError as e:
            elapsed_s = time.perf_counter() - started_s
            return SandboxResult(
                "", f"sandbox: could not start python: {e}", None, False, elapsed_s
            )
        try:
            return await _supervise(proc, limits, started_s)
        finally:
            if proc.returncode is None:  # cancelled: leave nothing behind
                _kill_group(proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


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
