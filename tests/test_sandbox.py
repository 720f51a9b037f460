"""The tool sandbox: real bubblewrap sandboxes, real limits (no fakes: the limits are the
point). The escape attempts are in tests/test_sandbox_escape.py."""

from __future__ import annotations

import ast
import asyncio
import math
import os
import time
from pathlib import Path

import pytest

from pearl_hpc.errors import ConfigError
from pearl_hpc.rollout.sandbox import SandboxLimits, SandboxResult, run_python, sandbox_problem

pytestmark = pytest.mark.skipif(sandbox_problem() is not None, reason=str(sandbox_problem()))


def run(code: str, **limits: float) -> SandboxResult:
    return asyncio.run(run_python(code, SandboxLimits(**limits)))  # type: ignore[arg-type]


def sandbox_processes(marker: bytes = b"pearl-sandbox") -> list[int]:
    """Live processes (bwrap and the interpreters in it) running the sandbox preamble."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if marker in cmdline and "Z" not in stat.rsplit(")", 1)[1].split()[:1]:
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
    result = run("print('up', flush=True)\nwhile True:\n    pass", timeout_s=0.5)
    assert time.perf_counter() - started_s < 8.0  # generous: other tests may load the CPUs
    assert result.timed_out and not result.ok
    assert result.exit_code == -9
    assert "timeout" in result.stderr
    assert result.stdout == "up\n"  # output printed before the timeout is kept
    time.sleep(0.3)  # the pid namespace goes with bwrap
    assert sandbox_processes() == []


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


def test_the_network_namespace_has_only_a_loopback() -> None:
    result = run("print(open('/proc/net/dev').read())")
    assert result.ok
    interfaces = [line.split(":")[0].strip() for line in result.stdout.splitlines()[2:] if line]
    assert interfaces == ["lo"]


def test_fork_and_subprocess_fail() -> None:
    assert "BlockingIOError" in run("import os\nos.fork()").stderr
    result = run("import subprocess\nsubprocess.run(['true'])")
    assert not result.ok and "Error" in result.stderr


def test_writes_stay_in_a_private_tmp_that_goes_with_the_sandbox() -> None:
    code = (
        "import os\n"
        "open('notes.txt', 'w').write('kept')\n"
        "print(os.getcwd())\n"
        "print(open('notes.txt').read())\n"
        "open('/pearl-sandbox-escape.txt', 'w')\n"
    )
    result = run(code)
    cwd, content = result.stdout.split()
    assert cwd == "/tmp" and content == "kept"
    assert "PermissionError" in result.stderr
    assert not Path("/pearl-sandbox-escape.txt").exists()
    assert not Path("/tmp/notes.txt").exists()  # the host's /tmp is not the sandbox's


def test_environment_is_minimal() -> None:
    os.environ["PEARL_TEST_SECRET"] = "do-not-leak"
    try:
        result = run("import os\nprint(sorted(os.environ))")
    finally:
        del os.environ["PEARL_TEST_SECRET"]
    assert result.ok
    assert "PEARL_TEST_SECRET" not in result.stdout
    allowed = {"PATH", "LC_ALL", "HOME", "TMPDIR", "LC_CTYPE", "PWD"}  # PWD: bwrap --chdir
    assert set(ast.literal_eval(result.stdout)) <= allowed


def test_it_runs_as_nobody_with_no_capabilities() -> None:
    result = run(
        "import os\nprint(os.getuid(), os.getgid(), os.getgroups())\n"
        "print([l for l in open('/proc/self/status') if l.startswith('CapEff')][0])"
    )
    assert result.stdout.splitlines()[0] == "65534 65534 []"
    assert result.stdout.split()[-1] == "0000000000000000"


def test_raising_limits_is_refused() -> None:
    code = "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))"
    assert "ValueError" in run(code).stderr  # an unprivileged process cannot raise a hard limit


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
            if sandbox_processes():
                break
        running = sandbox_processes()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.2)  # the child watcher reaps the killed child
        return running, sandbox_processes()

    running, left = asyncio.run(cancel_midway())
    assert len(running) >= 2  # bwrap and the interpreter in it
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


def test_the_seccomp_program_is_whole_instructions_for_known_machines() -> None:
    from pearl_hpc.rollout.seccomp import filter_program

    for machine in ("x86_64", "aarch64"):
        program = filter_program(machine)
        assert len(program) % 8 == 0 and 20 < len(program) // 8 < 256
    with pytest.raises(ValueError, match="no seccomp syscall table"):
        filter_program("sparc")
