"""The tool sandbox's seccomp filter: a classic-BPF program for ``bwrap --seccomp FD``.

It refuses (EPERM) the system calls a snippet could use to build new kernel attack
surface or re-arrange its view of the system: new namespaces (``unshare``, ``setns``,
``clone`` with a ``CLONE_NEW*`` flag), mounts, ``chroot``/``pivot_root``, ``ptrace``,
the kernel keyring, ``bpf``, ``perf_event_open`` and ``userfaultfd``. ``clone3`` gets
ENOSYS (its flags live in memory a filter cannot read), so the C library falls back to
``clone``, whose flags the filter checks. A call from another architecture's ABI kills
the process. Everything else is allowed: the other limits (uid nobody, rlimits,
namespaces, read-only mounts) do the rest.

    ld  arch        != native ──> KILL
    ld  nr          in BLOCKED ──> EPERM;  clone3 ──> ENOSYS
                    clone: flags & CLONE_NEW* ──> EPERM
    ALLOW
"""

from __future__ import annotations

import errno
import platform
import struct

# seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6]
_NR, _ARCH, _ARG0 = 0, 4, 16
_LD_ABS, _JEQ, _JSET, _RET = 0x20, 0x15, 0x45, 0x06  # BPF_LD|W|ABS, JMP|JEQ|K, JMP|JSET|K, RET|K
_ALLOW, _KILL = 0x7FFF0000, 0x80000000
_CLONE_NEW_FLAGS = 0x7E020080  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME

# (audit arch, syscall numbers) per machine
_ABIS = {
    "x86_64": (
        0xC000003E,
        {
            "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155,
            "chroot": 161, "ptrace": 101, "add_key": 248, "request_key": 249, "keyctl": 250,
            "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "open_tree": 428,
            "move_mount": 429, "fsopen": 430, "fsmount": 432, "clone": 56, "clone3": 435,
        },
    ),
    "aarch64": (
        0xC00000B7,
        {
            "unshare": 97, "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41,
            "chroot": 51, "ptrace": 117, "add_key": 217, "request_key": 218, "keyctl": 219,
            "bpf": 280, "perf_event_open": 241, "userfaultfd": 282, "open_tree": 428,
            "move_mount": 429, "fsopen": 430, "fsmount": 432, "clone": 220, "clone3": 435,
        },
    ),
}  # fmt: skip


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)  # struct sock_filter


def filter_program(machine: str | None = None) -> bytes:
    """The filter for ``machine`` (default: this one's), as ``bwrap --seccomp`` reads it.
    Raises ValueError for a machine it has no syscall table for."""
    machine = machine or platform.machine()
    if machine not in _ABIS:
        raise ValueError(f"no seccomp syscall table for {machine!r} (known: {sorted(_ABIS)})")
    arch, numbers = _ABIS[machine]
    blocked = [nr for name, nr in numbers.items() if name not in ("clone", "clone3")]
    # tail, counted back from the end: ALLOW, EPERM, ENOSYS, KILL
    tail = [
        _op(_RET, _ALLOW),
        _op(_RET, 0x00050000 | errno.EPERM),
        _op(_RET, 0x00050000 | errno.ENOSYS),
        _op(_RET, _KILL),
    ]
    body: list[tuple[int, int, str, str]] = [(_LD_ABS, _ARCH, "", "")]
    body.append((_JEQ, arch, "", "kill"))
    body.append((_LD_ABS, _NR, "", ""))
    body += [(_JEQ, nr, "eperm", "") for nr in blocked]
    body.append((_JEQ, numbers["clone3"], "enosys", ""))
    body.append((_JEQ, numbers["clone"], "", "allow"))
    body.append((_LD_ABS, _ARG0, "", ""))
    body.append((_JSET, _CLONE_NEW_FLAGS, "eperm", "allow"))
    where = {"allow": len(body), "eperm": len(body) + 1, "enosys": len(body) + 2}
    where["kill"] = len(body) + 3
    program = b""
    for i, (code, k, jt, jf) in enumerate(body):
        offset = {label: target - i - 1 for label, target in where.items()}
        program += _op(code, k, offset.get(jt, 0), offset.get(jf, 0))
    return program + b"".join(tail)
