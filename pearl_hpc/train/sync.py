"""The trainer's side of the weight propagation to the engines.

    stats = trainer.train_step(trajectories)                      # version v+1
    await sync.publish(sync.stage(trainer.state_dict(), v+1))    # to serving workers

:class:`WeightSync` is the trainer side of the weight propagation. Engines on trainer 0's
node (they read its probe in shared memory) map each version from the file it was staged
in (:mod:`pearl_hpc.weights.shm`); the others are ranks of a torch.distributed weight group
(gloo on CPU, NCCL on GPU) whose rank 0 is the trainer, and take each version in one
broadcast. A worker outside the broadcast group (released, or joined late) is not waited
for and catches up when it activates (lazy propagation): from shared memory, or with a
point-to-point copy. :class:`WeightVersions` keeps who holds what.

A member that dies during a publish (or while a group forms) fails it as
:class:`MembersLost`, naming every member found dead, whichever error came first: the
broadcast group is aborted at the first failure (a transfer blocked on the dead peer
ends), then each member is asked for its stats within ``PROBE_S``; the caller forms the
next epoch without the dead and publishes again.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import weakref
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, cast

import torch

from pearl_hpc.engine.client import EngineClient
from pearl_hpc.engine.store import KeyStore, StoreClient
from pearl_hpc.engine.types import EngineError, WeightsRefused
from pearl_hpc.errors import ConfigError
from pearl_hpc.weights.group import WeightGroup, send_weights
from pearl_hpc.weights.shm import SharedStore, Staged, stage_private
from pearl_hpc.weights.wire import BUCKET_BYTES, WeightSyncError, digest

log = logging.getLogger(__name__)

PROBE_S = 5.0  # a member that does not answer its stats this fast after a failure is dead


class MembersLost(WeightSyncError):
    """A publish or a group's forming failed and these members are dead."""

    def __init__(self, names: list[str], cause: BaseException) -> None:
        super().__init__(f"weights: {', '.join(names)} lost ({type(cause).__name__}: {cause})")
        self.names = names


class WeightSync:
    """Trainer-side weight propagation to engine workers.

    :meth:`stage` makes the engines' copy of a version (in ``shared`` memory when the
    trainer has a :class:`SharedStore`); :meth:`form` sorts a new membership epoch's
    serving workers into those on this node (they map each version) and the rest, over
    whom it builds the broadcast group (trainer = rank 0). A worker outside the epoch
    (released, or joined late) is not waited for: :meth:`catch_up` gives it the latest
    version (mapped, or point to point in a two-member group), and the next :meth:`form`
    includes it.

    The groups meet in this trainer's :class:`~pearl_hpc.engine.store.KeyStore` (the
    run's ``key`` first), under prefixes with a random part; each version's
    :func:`~pearl_hpc.weights.wire.digest` goes to its receivers over the authenticated
    RPC, and one whose bytes do not match refuses them (logged; it keeps serving what it
    held and takes the next version as usual).
    """

    def __init__(
        self,
        key: str,
        host: str = "127.0.0.1",
        backend: str = "gloo",
        max_staleness: int = 1,
        bucket_bytes: int = BUCKET_BYTES,
        shared: SharedStore | None = None,
    ) -> None:
        self.store = KeyStore(key, host)
        self.client = StoreClient(host, self.store.port, key)  # the trainer's side of groups
        self._tag = secrets.token_hex(8)  # in every group's prefix: not guessable
        # the digest of the last staged copy sent over a group (held weakly: a copy in
        # shared memory is a whole version, freed once nothing maps it)
        self._digested: tuple[weakref.ref[Staged], bytes] | None = None
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.shared = shared
        self.versions = WeightVersions(max_staleness=max_staleness)
        self.members: dict[str, EngineClient] = {}
        self.nearby: set[str] = set()  # members that map versions from shared memory
        self.leads: dict[str, list[str]] = {}  # the broadcast's receivers -> their node's others
        self.latest: Staged | None = None
        self.timings: list[tuple[str, int, float]] = []  # (how, version, seconds)
        self._group: WeightGroup | None = None
        self._epoch = 0
        # engines that hold versions received over the network (their node's others map
        # them: catch_up), and one catch-up at a time on each node (host name)
        self._engines: dict[str, EngineClient] = {}
        self._hosts: dict[str, str] = {}  # each engine's node (host name), once it said
        self._node_locks: dict[str, asyncio.Lock] = {}
        self._p2p = 0
        # client -> whether its engine sees this store's shared memory (asked once)
        self._shares: weakref.WeakKeyDictionary[EngineClient, bool] = weakref.WeakKeyDictionary()

    def stage(
        self, state: Mapping[str, torch.Tensor], version: int, dtype: torch.dtype | None = None
    ) -> Staged:
        """The engines' copy of ``version`` (floating tensors in ``dtype``, default as
        given): in shared memory when there is a store, else in this process's; hashed
        in the background from then on where the current epoch sends versions over the
        network (the publish, which needs the digest, follows the step's ack)."""
        digest = self._group is not None or self.shared is None
        if self.shared is None:
            return stage_private(state, version, dtype, digest=digest)
        return self.shared.stage(state, version, dtype, digest=digest)

    async def _group_of(
        self, name: str, prefix: str, members: Mapping[str, EngineClient], backend: str
    ) -> WeightGroup:
        size = 1 + len(members)
        host, port = self.store.host, self.store.port
        prefix = f"{prefix}{self._tag}/"
        trainer_side = asyncio.to_thread(WeightGroup, self.client, prefix, 0, size, backend)
        joined = await asyncio.gather(
            trainer_side,
            *[
                client.join_weights_group(name, host, port, prefix, rank, size, backend)
                for rank, client in enumerate(members.values(), start=1)
            ],
        )
        return cast(WeightGroup, joined[0])

    async def _sees_shared(self, client: EngineClient) -> bool:
        """Whether ``client``'s engine reads the store's probe (asked once per client)."""
        if self.shared is None:
            return False
        if client not in self._shares:
            self._shares[client] = await client.shares_memory(*self.shared.probe)
        return self._shares[client]

    async def form(self, members: Mapping[str, EngineClient]) -> None:
        """A new epoch over ``members`` (the serving workers): those on this node map each
        version; a broadcast group over the others (none if every one is here)."""
        self._epoch += 1
        self.members = dict(members)
        asked = [asyncio.ensure_future(self._sees_shared(c)) for c in members.values()]
        await self._all_or_lost(asked, members)
        sees = [task.result() for task in asked]
        self.nearby = {name for name, near in zip(members, sees, strict=True) if near}
        remote = {n: c for n, c in self.members.items() if n not in self.nearby}
        if self._group is not None:
            self._group.close()
            self._group = None
        by_node = asyncio.ensure_future(self._by_node(remote))
        await self._all_or_lost([by_node], remote)
        self.leads = by_node.result()
        if self.leads:
            prefix = f"bcast/{self._epoch}/"
            receivers = {n: remote[n] for n in self.leads}
            forming = asyncio.ensure_future(
                self._group_of("broadcast", prefix, receivers, self.backend)
            )
            await self._all_or_lost([forming], receivers)
            self._group = forming.result()

    async def _by_node(self, remote: Mapping[str, EngineClient]) -> dict[str, list[str]]:
        """``remote``'s engines by node: the first of each node (a *lead*) takes each
        version over the broadcast group, into its shared memory; the node's others
        (those that read back the lead's probe) map it from there. Lead -> followers."""
        shares = await asyncio.gather(*[c.weights_share() for c in remote.values()])
        leads: dict[str, list[str]] = {}
        first: dict[str, tuple[str, dict[str, Any]]] = {}  # host -> its lead, its share
        for (name, client), share in zip(remote.items(), shares, strict=True):
            self._hosts[name] = share["host"]
            lead = first.get(share["host"])
            probe = lead[1].get("probe") if lead is not None else None
            if lead is not None and probe and await client.shares_memory(*probe):
                leads[lead[0]].append(name)
                continue
            first.setdefault(share["host"], (name, share))
            leads[name] = []
        return leads

    @property
    def mapped(self) -> int:
        """Members that map each version instead of receiving it (from trainer 0's
        shared memory, or from their node's lead)."""
        return len(self.nearby) + sum(len(f) for f in self.leads.values())

    def seed(self, staged: Staged) -> None:
        """Start from ``staged`` (a resumed trainer): workers catch up to it as they join."""
        self.latest = staged
        self.versions.published(staged.version)

    async def publish(self, staged: Staged) -> float:
        """``staged`` to every serving member (one broadcast to the remote ones, a mapping
        for the nearby ones); returns the wall time."""
        if not self._epoch:
            raise WeightSyncError("WeightSync.publish before form(): no members")
        t0 = time.perf_counter()
        self.latest = staged
        self.versions.published(staged.version)
        sends: list[Awaitable[object]] = [
            self._deliver_nearby(n, c, staged) for n, c in self.members.items() if n in self.nearby
        ]
        refused: set[str] = set()
        if self._group is not None:
            check = await self._digest(staged)
            sends.append(asyncio.to_thread(self._send, self._group, staged, None))
            sends += [self._lead_and_followers(n, staged, check, refused) for n in self.leads]
        await self._all_or_lost([asyncio.ensure_future(s) for s in sends], self.members)
        for wid, client in self.members.items():
            if wid not in refused:
                self.versions.loaded(wid, staged.version)
            if wid not in self.nearby:
                self._engines[wid] = client
        if self.shared is not None:  # every member holds it: older files can go
            self.shared.unlink_before(staged.version)
        wall_s = time.perf_counter() - t0
        self.timings.append(("broadcast", staged.version, wall_s))
        return wall_s

    async def _all_or_lost(
        self, tasks: Sequence[asyncio.Future[Any]], members: Mapping[str, EngineClient]
    ) -> None:
        """Wait for ``tasks``. At the first failure: the broadcast group is aborted (the
        tasks left end with it; their errors follow from this one), every member is
        probed, and the dead are raised as :class:`MembersLost`; none dead: the failure
        itself is raised."""
        done, left = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t.exception() for t in done if t.exception() is not None), None)
        if failed is None:
            return
        for task in left:
            task.add_done_callback(_retrieved)
        if self._group is not None:
            self._group.close()
            self._group = None
        self.members = {}  # the next publish forms a new epoch
        alive = await asyncio.gather(*[_answers(c) for c in members.values()])
        dead = [name for name, ok in zip(members, alive, strict=True) if not ok]
        for name in dead:
            self._engines.pop(name, None)
            self._hosts.pop(name, None)
        if dead:
            raise MembersLost(dead, failed)
        raise failed

    async def _digest(self, staged: Staged) -> bytes:
        """``staged``'s digest (being hashed since it was staged, else computed once for
        each staged copy, in threads)."""
        if staged.digest is not None:
            return await asyncio.wrap_future(staged.digest)
        if self._digested is None or self._digested[0]() is not staged:
            check = await asyncio.to_thread(digest, staged.state.items())
            self._digested = (weakref.ref(staged), check)
        return self._digested[1]

    async def _receive(
        self, name: str, client: EngineClient, check: bytes, refused: set[str]
    ) -> None:
        """``name`` takes part in the broadcast; a refusal (its bytes did not match
        ``check``) is one warning, and it stays on the version it held."""
        try:
            await client.receive_weights("broadcast", check)
        except WeightsRefused as exc:
            log.warning("weights: %s", exc)
            refused.add(name)

    async def _lead_and_followers(
        self, lead: str, staged: Staged, check: bytes, refused: set[str]
    ) -> None:
        """``lead`` takes part in the broadcast; then its node's followers map what it
        received (one that cannot -- its file went, say -- gets it point to point); a
        refused version reaches none of them."""
        client = self.members[lead]
        await self._receive(lead, client, check, refused)
        followers = self.leads[lead]
        if not followers:
            return
        if lead in refused:
            refused.update(followers)
            return
        share = await client.weights_share()
        await asyncio.gather(*[self._map_or_send(f, share, staged) for f in followers])

    async def _map_or_send(self, name: str, share: dict[str, Any], staged: Staged) -> None:
        client = self.members[name]
        if share.get("version") == staged.version:
            try:
                await client.map_weights(share["path"], share["header"])
                return
            except EngineError as exc:
                log.warning("weights to %s from its node's lead: %s; point to point", name, exc)
        await self._point_to_point(name, client, staged, self.backend)

    def _send(self, group: WeightGroup, staged: Staged, dst: int | None) -> None:
        send_weights(group, staged.state, staged.version, dst=dst, bucket_bytes=self.bucket_bytes)

    async def _deliver_nearby(self, worker_id: str, client: EngineClient, staged: Staged) -> None:
        """A nearby worker maps the version's file (one staged privately, without room in
        shared memory, goes point to point)."""
        if staged.path is not None and staged.header is not None:
            await client.map_weights(staged.path, staged.header)
        else:  # host-staged: NCCL would refuse an engine on the trainer's own GPU
            await self._point_to_point(worker_id, client, staged, "gloo")

    async def _point_to_point(
        self, worker_id: str, client: EngineClient, staged: Staged, backend: str
    ) -> None:
        self._p2p += 1
        name = f"p2p-{self._p2p}"
        group = await self._group_of(name, f"p2p/{self._p2p}/", {worker_id: client}, backend)
        try:
            check = await self._digest(staged)
            await asyncio.gather(
                asyncio.to_thread(self._send, group, staged, 1),
                client.receive_weights(name, check, p2p=True),
            )
            await client.leave_weights_group(name)
        finally:
            group.close()

    async def catch_up(self, worker_id: str, client: EngineClient) -> float:
        """The latest version to a worker that missed broadcasts: mapped from shared
        memory if it is on this node, else mapped from an engine of its own node that
        received it (:meth:`_from_neighbour`), else point to point; nothing to one that
        holds it already (an engine re-activated, restarted or re-roled within a version
        keeps its weights: 16.4 GB not sent again at 8B)."""
        if self.latest is None:
            return 0.0
        staged = self.latest
        t0 = time.perf_counter()
        if (await client.stats()).weight_version == staged.version:
            self.versions.loaded(worker_id, staged.version)
            self.timings.append(("held", staged.version, 0.0))
            return 0.0
        how = "p2p"
        if await self._sees_shared(client):
            await self._deliver_nearby(worker_id, client, staged)
        else:
            host = (await client.weights_share())["host"]
            self._hosts[worker_id] = host
            async with self._node_locks.setdefault(host, asyncio.Lock()):  # one sent a node
                if await self._from_neighbour(worker_id, client, host, staged.version):
                    how = "neighbour"
                else:
                    await self._point_to_point(worker_id, client, staged, self.backend)
        self._engines[worker_id] = client
        self.versions.loaded(worker_id, staged.version)
        wall_s = time.perf_counter() - t0
        self.timings.append((how, staged.version, wall_s))
        return wall_s

    async def _from_neighbour(
        self, worker_id: str, client: EngineClient, host: str, version: int
    ) -> bool:
        """``client``'s engine maps ``version`` from an engine of its node that received
        it over the network and keeps it in shared memory (its probe read back: the same
        ``/dev/shm``); False where none does (or its file went: a newer version came)."""
        for name, donor in list(self._engines.items()):
            elsewhere = self._hosts.get(name, host) != host  # (no call to another node's)
            if name == worker_id or elsewhere or self.versions.version_of(name) != version:
                continue
            try:
                share = await donor.weights_share()
                if share["host"] != host or share.get("version") != version:
                    continue
                if not await client.shares_memory(*share["probe"]):
                    continue
                await client.map_weights(share["path"], share["header"])
            except (EngineError, OSError) as exc:  # the donor left, or its file did
                log.info("weights to %s from %s: %s; point to point instead", worker_id, name, exc)
                continue
            return True
        return False

    def close(self) -> None:
        """Tear down the broadcast group and remove the shared files (engines that
        mapped one keep it until they drop it)."""
        if self._group is not None:
            self._group.close()
            self._group = None
        self.client.close()
        self.store.close()
        if self.shared is not None:
            self.shared.close()


async def _answers(client: EngineClient) -> bool:
    """Whether ``client``'s worker answers within ``PROBE_S``."""
    try:
        await asyncio.wait_for(client.stats(), PROBE_S)
    except (EngineError, OSError, TimeoutError):
        return False
    return True


def _retrieved(task: asyncio.Future[Any]) -> None:
    """A task abandoned after a failure: its own error is the same event's."""
    if not task.cancelled():
        task.exception()


class WeightVersions:
    """Which rollout worker holds which weight version; pure bookkeeping (no torch).

    Rules:

    - The latest version starts at 0: every engine starts from the model directory, which
      is the trainer's version 0. ``published`` moves it forward (never back).
    - ``loaded`` records what a worker now holds; it cannot be ahead of the latest, and a
      worker never goes back (a restarted worker is ``forget``-ed first).
    - A worker *may generate* while ``version >= latest - max_staleness``: the trainer
      accepts its trajectories (its own ``max_staleness`` should be the same value).
    - A worker is *stale* while ``version < latest``: it needs a lazy sync before its next
      turn, though it may finish the current one if it still may generate.
    - An unknown worker holds nothing: it may not generate and is not listed as stale (it
      gets the weights when it registers with ``loaded``).
    """

    def __init__(self, max_staleness: int = 1) -> None:
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int):
            raise ConfigError(f"max_staleness must be an int, got {max_staleness!r}")
        if max_staleness < 0:
            raise ConfigError(
                f"max_staleness must be >= 0 (0 = fully on-policy), got {max_staleness}"
            )
        self.max_staleness = max_staleness
        self._latest = 0
        self._held: dict[str, int] = {}

    @property
    def latest(self) -> int:
        return self._latest

    def version_of(self, worker_id: str) -> int | None:
        """The version ``worker_id`` holds, or None for an unknown worker."""
        return self._held.get(worker_id)

    def published(self, version: int) -> None:
        """The trainer made ``version`` available (re-publishing the latest is a no-op)."""
        _check_version(version, "published")
        if version < self._latest:
            raise WeightSyncError(
                f"published version {version} is older than the latest ({self._latest}); "
                "versions only move forward"
            )
        self._latest = version

    def loaded(self, worker_id: str, version: int) -> None:
        """``worker_id`` now serves ``version``."""
        _check_version(version, f"loaded by {worker_id!r}")
        if version > self._latest:
            raise WeightSyncError(
                f"{worker_id!r} cannot load version {version}: the latest published is "
                f"{self._latest}; call published({version}) first"
            )
        held = self._held.get(worker_id)
        if held is not None and version < held:
            raise WeightSyncError(
                f"{worker_id!r} holds version {held} and cannot go back to {version}; "
                "forget() a restarted worker before it loads again"
            )
        self._held[worker_id] = version

    def forget(self, worker_id: str) -> None:
        """``worker_id`` left (or restarted); forgetting an unknown worker is a no-op."""
        self._held.pop(worker_id, None)

    def stale(self) -> list[str]:
        """Workers behind the latest version, sorted by id."""
        return sorted(w for w, v in self._held.items() if v < self._latest)

    def may_generate(self, worker_id: str) -> bool:
        held = self._held.get(worker_id)
        return held is not None and held >= self._latest - self.max_staleness


def _check_version(version: int, what: str) -> None:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise WeightSyncError(f"{what}: version must be an int >= 0, got {version!r}")
