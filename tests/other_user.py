"""Another user of a shared node, for the tests that a run's files are private: a real,
unprivileged local account (created as root, removed afterwards) that tries to read,
list and write every path of a run while it runs.

    with OtherUser() as other, other.watch(runs_dir) as watch:
        ...  # the run
    assert watch.scans >= 3 and watch.breaches == []
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

# stdlib only, run by the system interpreter (another user cannot reach a python under
# /root); paths on stdin, what it could do on stdout
_PROBE = r"""
import json, os, sys
done = []
for path in json.load(sys.stdin):
    try:
        if os.path.isdir(path):
            os.listdir(path)
            done.append("list " + path)
            fd = os.open(os.path.join(path, ".other-user"), os.O_WRONLY | os.O_CREAT, 0o600)
            os.close(fd)
            done.append("create in " + path)
        else:
            with open(path, "rb") as f:
                f.read(1)
            done.append("read " + path)
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
            done.append("write " + path)
    except OSError:
        pass
print(json.dumps(done))
"""
SYSTEM_PYTHON = "/usr/bin/python3"


def can_run() -> str | None:
    """Why these tests cannot run here (None: they can)."""
    if os.geteuid() != 0:
        return "creating another local user needs root (CI runs as root)"
    if not Path(SYSTEM_PYTHON).exists():
        return f"no {SYSTEM_PYTHON} for the other user to run"
    if subprocess.run(["which", "useradd"], capture_output=True).returncode:
        return "no useradd on this machine"
    return None


def open_to_others(root: Path) -> list[str]:
    """Each path under ``root`` (itself included) whose mode lets a group or others in."""
    found = []
    for top, _dirs, files in os.walk(root):
        for path in [top, *(os.path.join(top, name) for name in files)]:
            mode = os.lstat(path).st_mode
            if not stat.S_ISLNK(mode) and mode & 0o077:
                found.append(f"{stat.filemode(mode)} {path}")
    return found


class OtherUser:
    """A throwaway account with no groups and no home."""

    def __init__(self) -> None:
        self.name = f"pearl-other-{os.getpid()}"

    def __enter__(self) -> OtherUser:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
             self.name],
            check=True, capture_output=True,
        )  # fmt: skip
        entry = pwd.getpwnam(self.name)
        self.uid, self.gid = entry.pw_uid, entry.pw_gid
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["userdel", self.name], check=False, capture_output=True)

    def probe(self, paths: list[str]) -> list[str]:
        """What this user could do to ``paths`` (list, create in, read, write)."""
        out = subprocess.run(
            [SYSTEM_PYTHON, "-I", "-c", _PROBE],
            input=json.dumps(paths), capture_output=True, text=True, check=True, timeout=60,
            user=self.uid, group=self.gid, extra_groups=[], cwd="/",
        )  # fmt: skip
        return list(json.loads(out.stdout))

    @contextlib.contextmanager
    def watch(self, *roots: Path, every_s: float = 1.0) -> Iterator[Watch]:
        """Probe every path under ``roots`` (and this user's view of ``/dev/shm``'s
        pearl entries) every ``every_s`` until the block ends, and once more then."""
        watch = Watch(self, roots)
        thread = threading.Thread(target=watch.loop, args=(every_s,), daemon=True)
        thread.start()
        try:
            yield watch
        finally:
            watch.stop.set()
            thread.join(120)
            watch.scan()


class Watch:
    def __init__(self, other: OtherUser, roots: tuple[Path, ...]) -> None:
        self.other, self.roots = other, roots
        self.stop = threading.Event()
        self.scans = 0
        self.seen: set[str] = set()
        self.breaches: list[str] = []

    def paths(self) -> list[str]:
        found = []
        for root in self.roots:
            for top, _dirs, files in os.walk(root):
                found += [top] + [os.path.join(top, name) for name in files]
        shm = Path("/dev/shm")
        for entry in shm.glob("pearl-*") if shm.is_dir() else []:
            found.append(str(entry))
            if entry.is_dir():
                found += [str(p) for p in entry.iterdir()]
        return found

    def scan(self) -> None:
        paths = self.paths()
        mine = set(paths) - {str(r) for r in self.roots}  # the roots are the shared dirs
        done = self.other.probe(sorted(mine))
        self.scans += 1
        self.seen |= mine
        self.breaches += [d for d in done if d not in self.breaches]

    def loop(self, every_s: float) -> None:
        while not self.stop.wait(every_s):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                self.scan()


class Listeners:
    """Every TCP port a process under ``root_pid`` started during the block listens on,
    sampled every ``every_s`` (``ss -ltnp``) while the block runs: ``seen`` maps
    ``address:port`` to the programs. (Started during the block: what an earlier test
    left running under the same root is not the run's.)"""

    def __init__(self, root_pid: int, every_s: float = 1.0) -> None:
        self.root_pid, self.every_s = root_pid, every_s
        self.seen: dict[str, set[str]] = {}
        self.commands: dict[str, str] = {}  # address -> a listener's command line
        self.samples = 0
        self._stop = threading.Event()

    def _ours(self, pid: int) -> bool:
        try:
            stat_fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            return False
        if int(stat_fields[19]) < self._since_ticks:  # started before the block
            return False
        while pid > 1:
            if pid == self.root_pid:
                return True
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                return False
            pid = int(stat.rpartition(")")[2].split()[1])  # the parent's pid
        return False

    def sample(self) -> None:
        out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            fields = line.split()
            users = " ".join(fields[5:])
            for name, pid in re.findall(r'\("([^"]+)",pid=(\d+)', users):
                if self._ours(int(pid)):
                    self.seen.setdefault(fields[3], set()).add(name)
                    with contextlib.suppress(OSError):
                        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                        self.commands.setdefault(fields[3], cmd.decode(errors="replace")[:200])
        self.samples += 1

    def __enter__(self) -> Listeners:
        ticks = os.sysconf("SC_CLK_TCK")
        self._since_ticks = int(time.clock_gettime(time.CLOCK_BOOTTIME) * ticks) - 1

        def loop() -> None:
            while not self._stop.wait(self.every_s):
                with contextlib.suppress(subprocess.SubprocessError, OSError):
                    self.sample()

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def off_loopback(self) -> dict[str, set[str]]:
        """Listeners on anything but loopback: address -> the programs holding it."""
        return {a: p for a, p in self.seen.items() if not a.startswith(("127.0.0.1:", "[::1]:"))}
