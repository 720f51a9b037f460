"""The torch.distributed data plane: weight broadcast and KV hand-off groups, rebuilt from
every applied transition plan (one plan = one *epoch*).

Data flow::

    master (MPI rank 0)                         each worker, by member id ("base:3", "123+1:0")
    ───────────────────                         ────────────────────────────────────────────
    Rendezvous(host)  -> .host, .port  (once)
    plan = plan_groups(epoch, roles)  ──MPI──▶  dataplane.leave()          (previous epoch)
                                                dataplane.join(host, port, plan, member_id)
                                                  1. roll call under  epoch/<n>/
                                                  2. init_process_group, new_group per group
                                                dataplane.broadcast(weights)  trainer -> all
                                                dataplane.send / recv(kv)     prefill -> decode

Decisions (and why):

- **The master is not a member.** It owns the TCPStore and holds neither weights nor KV,
  so world ranks are the workers only: ``plan_groups`` rejects the id ``"master"``.
- **Ranks follow member ids in natural order** (``base:2`` before ``base:10``), so every
  member computes the same ranks from the same role map without talking to anyone.
- **``weights``** holds the training members and every rollout member (prefill, decode,
  colocated): today that is every member, so :class:`DataPlane` uses the default group for
  it rather than a second communicator over the same ranks. Its broadcast source is the
  lowest-ranked training member; with no trainer there is no source and ``broadcast``
  refuses.
- **One ``pd`` group** of all prefill and decode members (only when both exist), with
  point-to-point ``send``/``recv`` inside it. The router pairs any prefill worker with any
  decode worker turn by turn, so per-pair groups would need ``N_P * N_D`` ``new_group``
  calls, each entered by every rank, and (NCCL) one communicator each; point-to-point in
  one group sets up only the pairs actually used.
- **One key prefix per epoch** (``epoch/<n>/``). Before building groups every member
  checks in under it with the plan's digest (a *roll call*), so a missing member, a member
  holding a different plan or an id joining twice is an error that names it, instead of a
  hang inside the backend. Never reuse an epoch number with the same :class:`Rendezvous`
  (a retry included): the old keys would answer the new roll call.

torch is imported lazily, so :func:`plan_groups` works where torch is not installed.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType
from typing import TYPE_CHECKING

from pearl_hpc.core.types import Role
from pearl_hpc.errors import ConfigError, PearlError

if TYPE_CHECKING:
    import torch
    from torch._C._distributed_c10d import TCPStore  # torch.distributed re-exports it
    from torch.distributed.distributed_c10d import ProcessGroup, Store

MASTER_ID = "master"  # the store owner's id; never a data-plane member
WEIGHTS_GROUP = "weights"
PD_GROUP = "pd"
BACKEND_SETTINGS = ("auto", "gloo", "nccl")


class DataPlaneError(PearlError):
    """A data-plane plan, rendezvous or transfer failed; the message names the member,
    the epoch and what to check."""


# --------------------------------------------------------------------------- pure plan


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One named process group of an epoch."""

    name: str  # "weights" or "pd"
    ranks: tuple[int, ...]  # world ranks of its members, ascending
    source: int | None  # world rank a broadcast comes from; None where the group has none


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """Ranks and groups of one epoch, the same on every member. Build with
    :func:`plan_groups`."""

    epoch: int  # the transition plan this follows; one key prefix each
    members: tuple[str, ...]  # member id of each world rank (index = rank)
    roles: tuple[Role, ...]  # role of each world rank
    groups: tuple[GroupSpec, ...]  # created in this order on every rank

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def prefix(self) -> str:
        """Store key prefix of this epoch (PrefixStore adds the ``/``: keys read
        ``epoch/<n>/...``)."""
        return f"epoch/{self.epoch}"

    @property
    def digest(self) -> str:
        """Short hash of the plan; members compare it in the roll call."""
        text = repr((self.epoch, self.members, tuple(r.value for r in self.roles)))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def weights_source(self) -> str | None:
        """Member id the weights are broadcast from (lowest-ranked trainer), if any."""
        source = self.group(WEIGHTS_GROUP).source
        return None if source is None else self.members[source]

    def rank_of(self, member_id: str) -> int:
        try:
            return self.members.index(member_id)
        except ValueError:
            raise DataPlaneError(
                f"{member_id!r} is not a member of epoch {self.epoch}'s data plane "
                f"(members: {', '.join(self.members)})"
            ) from None

    def role_of(self, member_id: str) -> Role:
        return self.roles[self.rank_of(member_id)]

    def has_group(self, name: str) -> bool:
        return any(g.name == name for g in self.groups)

    def group(self, name: str) -> GroupSpec:
        for spec in self.groups:
            if spec.name == name:
                return spec
        raise DataPlaneError(
            f"epoch {self.epoch} has no group {name!r}; its groups are "
            f"{', '.join(g.name for g in self.groups)}"
            + (" (pd needs at least one prefill and one decode member)" if name == PD_GROUP else "")
        )


def _member_sort_key(member_id: str) -> tuple[tuple[tuple[int, str], ...], str]:
    """Natural order: digit runs compare as numbers; the raw id breaks ties ("a01"/"a1")."""
    parts = re.split(r"(\d+)", member_id)
    chunks = tuple((int(p), "") if i % 2 else (0, p) for i, p in enumerate(parts))
    return chunks, member_id


def _check_roles(epoch: int, roles: Mapping[str, Role | str]) -> dict[str, Role]:
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise DataPlaneError(f"epoch must be an int >= 0, got {epoch!r}")
    if not roles:
        raise DataPlaneError(f"epoch {epoch} has no members: the role map is empty")
    checked: dict[str, Role] = {}
    valid = ", ".join(r.value for r in Role)
    for member_id, role in roles.items():
        if not isinstance(member_id, str) or not member_id.strip():
            raise DataPlaneError(f"member ids must be non-empty strings, got {member_id!r}")
        if member_id == MASTER_ID:
            raise DataPlaneError(
                f"{MASTER_ID!r} owns the rendezvous store and is not a data-plane member; "
                "pass only the workers' roles"
            )
        try:
            checked[member_id] = Role(role)
        except ValueError:
            raise DataPlaneError(
                f"member {member_id!r} has role {role!r}; valid roles: {valid}"
            ) from None
    return checked


def plan_groups(epoch: int, roles: Mapping[str, Role | str]) -> GroupPlan:
    """World ranks and named groups for ``epoch`` from each worker's role.

    Deterministic: ranks follow the member ids in natural order, groups come in the order
    ``weights``, ``pd``. ``pd`` exists only with at least one prefill and one decode member.
    """
    checked = _check_roles(epoch, roles)
    members = tuple(sorted(checked, key=_member_sort_key))
    member_roles = tuple(checked[m] for m in members)
    trainers = [r for r, role in enumerate(member_roles) if role is Role.TRAINING]
    weights = tuple(
        r for r, role in enumerate(member_roles) if role is Role.TRAINING or role.is_rollout
    )
    groups = [GroupSpec(WEIGHTS_GROUP, weights, trainers[0] if trainers else None)]
    prefill = [r for r, role in enumerate(member_roles) if role is Role.PREFILL]
    decode = [r for r, role in enumerate(member_roles) if role is Role.DECODE]
    if prefill and decode:
        groups.append(GroupSpec(PD_GROUP, tuple(sorted(prefill + decode)), None))
    return GroupPlan(epoch, members, member_roles, tuple(groups))


# --------------------------------------------------------------------------- torch side


def _torch_dist() -> ModuleType:
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise DataPlaneError(
            f"the data plane needs torch ({exc}); install it: pip install 'pearl-hpc[dist]'"
        ) from exc
    if not dist.is_available():
        raise DataPlaneError("this torch build has no torch.distributed support")
    return dist


def select_backend(setting: str = "auto") -> str:
    """``"nccl"`` or ``"gloo"`` for a config setting ``auto | gloo | nccl``: auto picks NCCL
    only where CUDA is available."""
    if setting not in BACKEND_SETTINGS:
        raise ConfigError(
            f"data-plane backend {setting!r} is not one of {', '.join(BACKEND_SETTINGS)}"
        )
    if setting == "gloo":
        return "gloo"
    _torch_dist()
    import torch

    if torch.cuda.is_available():
        return "nccl"
    if setting == "nccl":
        raise ConfigError(
            "data-plane backend 'nccl' needs CUDA, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}); set the backend to 'auto' or 'gloo' on CPU machines"
        )
    return "gloo"


class Rendezvous:
    """The master's TCPStore that every epoch's members meet in. The master is not a
    member; it only serves keys. Construct once per run; ``close()`` stops accepting new
    connections (members still connected finish their epoch)."""

    def __init__(self, host: str = "", port: int = 0, timeout_s: float = 300.0) -> None:
        """``host``: the address workers connect to (default: this machine's hostname);
        ``port``: 0 picks a free one, read it back from ``.port``."""
        import socket

        dist = _torch_dist()
        self.host = host or socket.gethostname()
        try:
            self._store: TCPStore | None = dist.TCPStore(
                self.host,
                port,
                world_size=None,
                is_master=True,
                timeout=timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
        except RuntimeError as exc:
            raise DataPlaneError(
                f"cannot start the rendezvous store on {self.host}:{port}: {exc}; "
                "pick another port (0 = any free one)"
            ) from exc
        self.port: int = int(self._store.port)

    def close(self) -> None:
        self._store = None

    def __enter__(self) -> Rendezvous:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class DataPlane:
    """One worker's membership in the data plane, one epoch at a time.

    ========  ==========  ==========================================================
    state     call        next
    ========  ==========  ==========================================================
    left      ``join``    joined (on failure: left, with a DataPlaneError)
    joined    ``leave``   left (a no-op when already left, for cleanup paths)
    joined    ``join``    error: leave the previous epoch first
    ========  ==========  ==========================================================

    The data plane owns the process's default process group: a process that already has
    one (e.g. its own training world) cannot join. With NCCL, call
    ``torch.cuda.set_device`` before ``join`` and pass CUDA tensors.
    """

    def __init__(self) -> None:
        self._plan: GroupPlan | None = None
        self._member_id = ""
        self._backend = ""
        self._store: Store | None = None
        self._groups: dict[str, ProcessGroup | None] = {}  # None: not a member

    @property
    def joined(self) -> bool:
        return self._plan is not None

    @property
    def plan(self) -> GroupPlan:
        if self._plan is None:
            raise DataPlaneError("this worker has not joined the data plane: call join() first")
        return self._plan

    @property
    def rank(self) -> int:
        return self.plan.rank_of(self._member_id)

    @property
    def backend(self) -> str:
        return self._backend

    def join(
        self,
        host: str,
        port: int,
        plan: GroupPlan,
        member_id: str,
        backend: str = "auto",
        timeout_s: float = 300.0,
    ) -> None:
        """Meet the other members of ``plan`` at the master's store and build the groups.
        Returns once every member has checked in; ``timeout_s`` bounds the wait and every
        later transfer of this epoch."""
        dist = _torch_dist()
        if self._plan is not None:
            raise DataPlaneError(
                f"{member_id!r} is still in epoch {self._plan.epoch}: leave() before joining "
                f"epoch {plan.epoch}"
            )
        if dist.is_initialized():
            raise DataPlaneError(
                f"{member_id!r} cannot join: this process already has a default process "
                "group, and the data plane owns it; use a separate process"
            )
        rank = plan.rank_of(member_id)
        resolved = select_backend(backend)
        timeout = timedelta(seconds=timeout_s)
        where = f"{member_id!r} (rank {rank} of {plan.world_size}) in epoch {plan.epoch}"
        try:
            client = dist.TCPStore(host, port, world_size=None, is_master=False, timeout=timeout)
        except RuntimeError as exc:
            raise DataPlaneError(
                f"{where} cannot reach the rendezvous store at {host}:{port} within "
                f"{timeout_s:g} s: {exc}; check the master is up and the address"
            ) from exc
        store = dist.PrefixStore(plan.prefix, client)
        _roll_call(store, plan, rank, timeout, where)
        try:
            dist.init_process_group(
                resolved, store=store, rank=rank, world_size=plan.world_size, timeout=timeout
            )
            groups: dict[str, ProcessGroup | None] = {}
            for spec in plan.groups:  # same order on every rank: new_group is collective
                if len(spec.ranks) == plan.world_size:
                    groups[spec.name] = dist.group.WORLD
                else:
                    group = dist.new_group(list(spec.ranks), timeout=timeout)
                    groups[spec.name] = None if rank not in spec.ranks else group
        except (RuntimeError, ValueError) as exc:
            if dist.is_initialized():
                dist.destroy_process_group()
            raise DataPlaneError(f"{where} failed to build its {resolved} groups: {exc}") from exc
        self._plan, self._member_id, self._backend = plan, member_id, resolved
        self._store, self._groups = store, groups

    def leave(self, timeout_s: float = 30.0) -> tuple[str, ...]:
        """Wait (at most ``timeout_s``) until every member has left, so no transfer is cut
        off, then destroy the groups and the default group. Returns the members that did
        not arrive in time (empty when all left together): a dead peer does not stop a
        worker from moving on to the next epoch."""
        if self._plan is None:
            return ()
        dist = _torch_dist()
        plan, rank, store = self._plan, self.rank, self._store
        assert store is not None
        missing: tuple[str, ...] = ()
        keys = [f"left/{r}" for r in range(plan.world_size)]
        try:
            store.set(keys[rank], "1")
            store.wait(keys, timedelta(seconds=timeout_s))
        except RuntimeError:
            missing = _absent(store, keys, plan)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()  # the default group and every subgroup
            self._plan, self._store, self._groups = None, None, {}
        return missing

    def broadcast(self, tensors: Sequence[torch.Tensor], group: str = WEIGHTS_GROUP) -> None:
        """Send ``tensors`` from the group's source to every member, in place. Every member
        of the group calls this with tensors of the same shapes and dtypes, in the same
        order."""
        dist = _torch_dist()
        plan = self.plan
        spec = plan.group(group)
        if spec.source is None:
            raise DataPlaneError(
                f"epoch {plan.epoch} has no source for {group!r}: no training member"
            )
        pg = self._member_group(group)
        for tensor in tensors:
            self._check_tensor(tensor, f"broadcast on {group!r}")
        try:
            works = [dist.broadcast(t, src=spec.source, group=pg, async_op=True) for t in tensors]
            for work in works:
                work.wait()
        except RuntimeError as exc:
            raise DataPlaneError(
                f"broadcast on {group!r} from {plan.members[spec.source]!r} failed at "
                f"{self._member_id!r} in epoch {plan.epoch}: {exc}"
            ) from exc

    def send(self, tensor: torch.Tensor, to_member: str) -> None:
        """Send ``tensor`` to another member of the pd group (KV hand-off); blocks until
        the buffer may be reused. The peer calls :meth:`recv` with a same-shaped tensor."""
        dist = _torch_dist()
        peer = self._pd_peer(to_member, "send to")
        self._check_tensor(tensor, f"send to {to_member!r}")
        try:
            dist.send(tensor, dst=peer, group=self._member_group(PD_GROUP))
        except RuntimeError as exc:
            raise DataPlaneError(
                f"send from {self._member_id!r} to {to_member!r} failed in epoch "
                f"{self.plan.epoch}: {exc}"
            ) from exc

    def recv(self, tensor: torch.Tensor, from_member: str) -> None:
        """Receive into ``tensor`` what ``from_member`` sends within the pd group."""
        dist = _torch_dist()
        peer = self._pd_peer(from_member, "receive from")
        self._check_tensor(tensor, f"recv from {from_member!r}")
        try:
            dist.recv(tensor, src=peer, group=self._member_group(PD_GROUP))
        except RuntimeError as exc:
            raise DataPlaneError(
                f"recv at {self._member_id!r} from {from_member!r} failed in epoch "
                f"{self.plan.epoch}: {exc}"
            ) from exc

    def _member_group(self, name: str) -> ProcessGroup:
        plan = self.plan
        plan.group(name)  # names the epoch's groups when ``name`` is unknown
        pg = self._groups.get(name)
        if pg is None:
            raise DataPlaneError(
                f"{self._member_id!r} ({plan.role_of(self._member_id).value}) is not in "
                f"epoch {plan.epoch}'s {name!r} group"
            )
        return pg

    def _pd_peer(self, member_id: str, verb: str) -> int:
        plan = self.plan
        pd_ranks = plan.group(PD_GROUP).ranks
        peer = plan.rank_of(member_id)
        if peer == self.rank:
            raise DataPlaneError(f"{self._member_id!r} cannot {verb} itself")
        if peer not in pd_ranks:
            raise DataPlaneError(
                f"{self._member_id!r} cannot {verb} {member_id!r}: it is "
                f"{plan.roles[peer].value}, and the pd group holds prefill and decode members"
            )
        return peer

    def _check_tensor(self, tensor: torch.Tensor, what: str) -> None:
        wanted = "cuda" if self._backend == "nccl" else "cpu"
        if tensor.device.type != wanted:
            raise DataPlaneError(
                f"{what}: the {self._backend} backend needs {wanted} tensors, got one on "
                f"{tensor.device}"
            )
        if not tensor.is_contiguous():
            raise DataPlaneError(f"{what}: the tensor is not contiguous; call .contiguous()")


def _roll_call(store: Store, plan: GroupPlan, rank: int, timeout: timedelta, where: str) -> None:
    """Check in under the epoch's prefix and wait for every member with the same plan."""
    keys = [f"rollcall/{r}" for r in range(plan.world_size)]
    try:
        if store.add(f"claim/{rank}", 1) != 1:
            raise DataPlaneError(
                f"{where}: another process already joined as {plan.members[rank]!r}; "
                "member ids must be unique"
            )
        store.set(keys[rank], plan.digest)
        store.wait(keys, timeout)
        digests = [bytes(v).decode() for v in store.multi_get(keys)]
    except RuntimeError as exc:
        missing = _absent(store, keys, plan)
        raise DataPlaneError(
            f"{where}: {', '.join(missing) or 'some members'} did not join within "
            f"{timeout.total_seconds():g} s ({exc}); check those workers are alive and "
            "received the plan"
        ) from exc
    other = [plan.members[r] for r, d in enumerate(digests) if d != plan.digest]
    if other:
        raise DataPlaneError(
            f"{where}: {', '.join(other)} joined with a different plan for this epoch "
            "(digest mismatch); every member must get the same plan"
        )


def _absent(store: Store, keys: Sequence[str], plan: GroupPlan) -> tuple[str, ...]:
    """Members whose key is not in the store (best effort: the store may be gone)."""
    try:
        return tuple(plan.members[r] for r, key in enumerate(keys) if not store.check([key]))
    except RuntimeError:
        return ()
