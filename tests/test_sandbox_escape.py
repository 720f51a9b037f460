"""Escape attempts against the tool sandbox, through the entry point the agent loop uses
(``make_env("calc").step`` with a ``<python>`` action): host files, other processes,
writes outside the sandbox's /tmp, the network, ctypes, fork/exec, signals, processes
outliving the limit, memory and threads. Every one is refused; where the attempt would
leave a trace on the host, the host is checked too."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import pytest

from pearl_hpc.rollout.envs import make_env
from pearl_hpc.rollout.sandbox import sandbox_problem

pytestmark = pytest.mark.skipif(sandbox_problem() is not None, reason=str(sandbox_problem()))


def attempt(body: str, **limits: float) -> str:
    """Run ``body`` as a tool call; it prints ESCAPED if it got through, else
    ``refused <exception>``. Returns the observation the policy would see."""
    code = "try:\n" + textwrap.indent(textwrap.dedent(body).strip(), "    ")
    code += (
        "\n    print('ESCAPED')\nexcept BaseException as e:\n    print('refused', type(e).__name__)"
    )
    options = {"limits": {"timeout_s": 5.0, **limits}, "max_observation_chars": 4000}

    async def go() -> str:
        env = make_env("calc", **options)
        await env.reset(0)
        step = await env.step(f"<python>{code}</python>")
        return str(step.info["tool_output"])

    return asyncio.run(go())


def refused(out: str) -> bool:
    return "ESCAPED" not in out and "refused" in out


HOST_FILE_ATTEMPTS = {
    "etc-shadow": "open('/etc/shadow').read()",
    "root-home": "os.listdir('/root/.ssh')",
    "proc-1-root": "open('/proc/1/root/etc/shadow').read()",
}


@pytest.mark.parametrize("body", HOST_FILE_ATTEMPTS.values(), ids=HOST_FILE_ATTEMPTS.keys())
def test_host_files_are_not_there(body: str) -> None:
    assert refused(attempt("import os\n" + body))


def test_a_private_key_file_of_the_run_is_not_reachable(tmp_path: Path) -> None:
    key = tmp_path / "rpc.key"
    key.write_text("secret")
    key.chmod(0o600)
    assert refused(attempt(f"print(open({str(key)!r}).read())"))


def test_other_processes_and_their_environments_are_invisible() -> None:
    os.environ["PEARL_TEST_SECRET"] = "do-not-leak"  # in this process's /proc/PID/environ
    try:
        out = attempt(
            """
            import os
            pids = [p for p in os.listdir('/proc') if p.isdigit()]
            print('pids', len(pids))
            for p in pids:
                try:
                    assert b'do-not-leak' not in open(f'/proc/{p}/environ', 'rb').read()
                except PermissionError:  # the sandbox's init (bwrap) is root's
                    pass
            assert len(pids) <= 3  # bwrap's init, this interpreter (and a reaper)
            raise PermissionError('only the sandbox is visible')
            """
        )
    finally:
        del os.environ["PEARL_TEST_SECRET"]
    assert refused(out) and "pids" in out


WRITE_ATTEMPTS = {
    "root": "open('/escape.txt', 'w').write('x')",
    "usr": "open('/usr/escape.txt', 'w').write('x')",
    "interpreter": "import os; open(os.__file__ + '.escape', 'w').write('x')",
    "chdir-relative": "import os; os.chdir('/usr/lib'); open('escape.txt', 'w').write('x')",
    "dir-fd": "import os; fd = os.open('/usr', os.O_RDONLY); "
    "os.open('escape.txt', os.O_CREAT | os.O_WRONLY, dir_fd=fd)",
    "mkfifo": "import os; os.mkfifo('/usr/escape.fifo')",
    "snippet": "open('/sandbox/snippet.py', 'a').write('x')",
    "tmpfs-full": "[open(f'/tmp/f{i}', 'wb').write(b'x' * (1 << 20)) for i in range(64)]",
}


@pytest.mark.parametrize("body", WRITE_ATTEMPTS.values(), ids=WRITE_ATTEMPTS.keys())
def test_writes_outside_the_private_tmp_fail(body: str) -> None:
    assert refused(attempt(body))
    assert not Path("/escape.txt").exists() and not Path("/usr/escape.txt").exists()
    assert not Path("/usr/lib/escape.txt").exists() and not Path("/usr/escape.fifo").exists()


def test_no_network_not_even_to_the_hosts_loopback() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(3)
    port = server.getsockname()[1]
    accepted: list[object] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            accepted.append(server.accept())

    thread = threading.Thread(target=accept)
    thread.start()
    out = attempt(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)")
    host_ip = socket.gethostbyname(socket.gethostname())
    out2 = attempt(f"import socket\nsocket.create_connection(({host_ip!r}, {port}), timeout=2)")
    thread.join()
    server.close()
    assert refused(out) and refused(out2) and accepted == []


PRIVILEGE_ATTEMPTS = {
    "ctypes-unshare-user": "import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"
    "assert libc.unshare(0x10000000) == 0",  # CLONE_NEWUSER
    "ctypes-setns": "import ctypes, os; libc = ctypes.CDLL(None, use_errno=True)\n"
    "fd = os.open('/proc/1/ns/net', os.O_RDONLY)\nassert libc.setns(fd, 0) == 0\n"
    "import socket; socket.create_connection(('127.0.0.1', 22), timeout=1)",
    "setuid-root": "import os; os.setuid(0)",
    "raise-a-limit": "import resource; resource.setrlimit(resource.RLIMIT_NPROC, (100, 100))",
    "mount": "import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"
    "assert libc.mount(b'none', b'/tmp', b'tmpfs', 0, None) == 0",
}


@pytest.mark.parametrize("body", PRIVILEGE_ATTEMPTS.values(), ids=PRIVILEGE_ATTEMPTS.keys())
def test_no_privilege_can_be_regained(body: str) -> None:
    assert refused(attempt(body))


PROCESS_ATTEMPTS = {
    "fork": "import os; os.fork()",
    "system": "import os; assert os.system('true') == 0",
    "subprocess": "import subprocess; subprocess.run(['true'], check=True)",
    "posix-spawn": "import os; os.posix_spawn('/usr/bin/true', ['true'], {})",
    "setsid-fork": "import os; os.setsid(); os.fork()",
    "thread": "import threading; threading.Thread(target=print).start()",
}


@pytest.mark.parametrize("body", PROCESS_ATTEMPTS.values(), ids=PROCESS_ATTEMPTS.keys())
def test_no_new_process_or_thread(body: str) -> None:
    assert refused(attempt(body))


def test_signals_do_not_reach_host_processes() -> None:
    victim = subprocess.Popen(["sleep", "30"])
    try:
        out = attempt(f"import os, signal\nos.kill({victim.pid}, signal.SIGKILL)")
        time.sleep(0.2)
        assert victim.poll() is None, "a host process was killed from the sandbox"
        assert refused(out) or "ESCAPED" in out  # pid numbers are the sandbox's own
        # killing its own init ends the sandbox, nothing else
        attempt("import os, signal\nos.kill(1, signal.SIGKILL)")
        assert victim.poll() is None
    finally:
        victim.kill()


def test_nothing_outlives_the_time_limit() -> None:
    out = attempt("import time\ntime.sleep(30)", timeout_s=1.0)
    assert "ESCAPED" not in out and "timed out" in out
    time.sleep(0.3)
    left = subprocess.run(["pgrep", "-f", "pearl-sandbox"], capture_output=True, text=True)
    assert left.stdout.strip() == ""


@pytest.mark.parametrize(
    "body",
    ["bytearray(1 << 31)", "x = []\nwhile True:\n    x.append(bytearray(1 << 24))"],
    ids=["one-block", "growing"],
)
def test_memory_is_bounded(body: str) -> None:
    assert refused(attempt(body, memory_mb=128))
