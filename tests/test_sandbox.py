"""The tool sandbox: real child processes, real limits (no fakes: the limits are the point)."""

from __future__ import annotations

import ast
import asyncio
import math
import os
import time
from pathlib import Path

import pytest

from pearl_hpc.errors import ConfigError
from pearl_hpc.rollout import sandbox
from pearl_hpc.rollout.sandbox import SandboxLimits, SandboxResult, network_isolation, run_python


def run(code: str, **limits: float) -> SandboxResult:
    return asyncio.run(run_python(code, SandboxLimits(**limits)))  # type: ignore[arg-type]


def sandbox_children() -> list[int]:
    """Live children of this test process that run the sandbox preamble."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and b"_install_hook" in cmdline:
            pids.append(int(entry.name))
    return pids


def test_runs_code_and_returns_stdout() -> None:
    result = run("print(2 + 3)")
    assert result.ok
    assert result.stdout == "5\n"
    assert result.stderr == ""
    assert result.exit_code == 0
    assert result.wall_s > 0


def test_nonzero_exit_and_stderr() -> None:
    result = run("import sys\nsys.stderr.write('bad input')\nsys.exit(3)")
    assert not result.ok
    assert result.exit_code == 3
    assert "bad input" in result.stderr


def test_exception_traceback_names_the_snippet_not_the_preamble() -> None:
    result = run("x = 1\n1 / 0")
    assert result.exit_code == 1
    assert 'File "snippet.py", line 2' in result.stderr
    assert result.stderr.rstrip().endswith("ZeroDivisionError: division by zero")


def test_syntax_error_is_reported() -> None:
    result = run("def f(:")
    assert result.exit_code == 1
    assert "SyntaxError" in result.stderr


def test_infinite_loop_times_out_and_the_process_is_gone() -> None:
    started_s = time.perf_counter()
    result = run("import os\nprint(os.getpid(), flush=True)\nwhile True:\n    pass", timeout_s=0.5)
    assert time.perf_counter() - started_s < 8.0  # generous: other tests may load the CPUs
    assert result.timed_out and not result.ok
    assert result.exit_code == -9
    assert "timeout" in result.stderr
    pid = int(result.stdout.split()[0])  # output printed before the timeout is kept
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_cpu_limit_kills_a_busy_loop_before_the_wall_clock() -> None:
    result = run("while True:\n    pass", timeout_s=30.0, cpu_s=1)
    assert not result.timed_out  # the CPU limit, not the 30 s wall clock, ended it
    assert result.exit_code in (-24, -9)  # SIGXCPU at the soft limit, SIGKILL at the hard


@pytest.mark.parametrize(
    "code",
    ["x = bytearray(1 << 30)", "chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 22))"],
    ids=["one-allocation", "growing"],
)
def test_memory_bomb_is_contained(code: str) -> None:
    result = run(code, memory_mb=128, timeout_s=5.0)
    assert not result.ok and not result.timed_out
    assert "MemoryError" in result.stderr


def test_huge_output_is_truncated() -> None:
    result = run("print('x' * 100_000)\nprint('done')", max_output_bytes=1000)
    assert result.ok  # the snippet itself finished normally
    assert result.stdout.startswith("x" * 1000)
    assert len(result.stdout) < 1000 + 64
    assert "more bytes truncated" in result.stdout


def test_endless_output_is_killed_early() -> None:
    result = run("while True:\n    print('y' * 1000)", timeout_s=30.0, max_output_bytes=1000)
    assert not result.timed_out and not result.ok  # killed for the flood, not the timeout
    assert result.exit_code == -9
    assert "bytes of output" in result.stderr


def test_socket_creation_fails_inside() -> None:
    result = run("import socket\ns = socket.socket()\nprint('opened')")
    assert not result.ok
    assert "opened" not in result.stdout
    assert "PermissionError" in result.stderr


def test_socket_creation_fails_with_the_audit_hook_alone() -> None:
    code = "import socket\nsocket.create_connection(('127.0.0.1', 9))\nprint('connected')"
    result = asyncio.run(sandbox._run(code, SandboxLimits(), netns=False))
    assert not result.ok
    assert "connected" not in result.stdout
    assert "socket" in result.stderr


def test_network_namespace_has_only_loopback() -> None:
    if network_isolation() != "netns":
        pytest.skip("unshare --net does not work here; the audit hook is the only guard")
    result = run("print(open('/proc/net/dev').read())")
    assert result.ok
    interfaces = [line.split(":")[0].strip() for line in result.stdout.splitlines()[2:] if line]
    assert interfaces == ["lo"]


def test_network_isolation_is_probed_once() -> None:
    assert network_isolation() in ("netns", "audit-hook")
    assert network_isolation() is network_isolation()


def test_fork_and_subprocess_are_refused() -> None:
    assert "os.fork" in run("import os\nos.fork()").stderr
    assert "subprocess" in run("import subprocess\nsubprocess.run(['true'])").stderr


def test_writes_stay_in_a_temporary_directory_that_is_removed() -> None:
    code = (
        "import os\n"
        "open('notes.txt', 'w').write('kept')\n"
        "print(os.getcwd())\n"
        "print(open('notes.txt').read())\n"
        "open('/tmp/pearl-sandbox-escape.txt', 'w')\n"
    )
    result = run(code)
    cwd, content = result.stdout.split()
    assert content == "kept"
    assert "PermissionError" in result.stderr
    assert not Path("/tmp/pearl-sandbox-escape.txt").exists()
    assert not Path(cwd).exists()


def test_environment_is_minimal() -> None:
    os.environ["PEARL_TEST_SECRET"] = "do-not-leak"
    try:
        result = run("import os\nprint(sorted(os.environ))")
    finally:
        del os.environ["PEARL_TEST_SECRET"]
    assert result.ok
    assert "PEARL_TEST_SECRET" not in result.stdout
    assert set(ast.literal_eval(result.stdout)) <= {"PATH", "LC_ALL", "HOME", "TMPDIR", "LC_CTYPE"}


def test_raising_limits_is_refused() -> None:
    code = "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))"
    assert "resource.setrlimit" in run(code).stderr


def test_twenty_concurrent_sandboxes_complete() -> None:
    async def many() -> list[SandboxResult]:
        return await asyncio.gather(*(run_python(f"print({i} * {i})") for i in range(20)))

    results = asyncio.run(many())
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(20)]
    assert all(r.ok for r in results)


def test_cancelling_the_caller_kills_the_child() -> None:
    async def cancel_midway() -> tuple[list[int], list[int]]:
        task = asyncio.create_task(run_python("while True:\n    pass", SandboxLimits(10.0)))
        for _ in range(100):  # until the child is up
            await asyncio.sleep(0.02)
            if sandbox_children():
                break
        running = sandbox_children()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.2)  # the child watcher reaps the killed child
        return running, sandbox_children()

    running, left = asyncio.run(cancel_midway())
    assert len(running) == 1
    assert left == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("timeout_s", 0),
        ("timeout_s", -1.0),
        ("timeout_s", math.inf),
        ("timeout_s", math.nan),
        ("cpu_s", 0),
        ("cpu_s", 1.5),
        ("memory_mb", 0),
        ("memory_mb", 8),
        ("max_output_bytes", -5),
        ("max_output_bytes", True),
    ],
)
def test_bad_limits_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        SandboxLimits(**{field: value})  # type: ignore[arg-type]
