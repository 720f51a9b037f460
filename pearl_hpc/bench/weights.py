"""Weight sync to an engine on trainer 0's node: the gloo weight group (host-staged
buckets, what engines on other nodes get) against the shared-memory file the engine maps,
side by side, on a synthetic bf16 model of a chosen size.

    pearl-hpc bench --weights [--gib 1] [--repeats 3] [--json]
    pearl-hpc bench --weights --at-scale     # one version at 8B and 30B-A3B, by arithmetic

Per repeat and path, this process plays trainer 0 and a second process the engine:
- **stage**: the trainer casts its fp32 host copy to bf16, into private memory (gloo)
  or into the version's file in ``/dev/shm`` (shared memory);
- **deliver**: from the staged copy to the engine holding the version in host memory
  (gloo: the trainer's SHA-256 of it, every bucket received into the engine's file in
  ``/dev/shm``, hashed as the next arrives, over a group formed once beforehand, as for
  a membership epoch, and the digest checked; shared memory: the file mapped);
- **load**: the engine copies every tensor into its own parameters (what vLLM's loader
  does), reading the pages it was given.
Transport only: no vLLM engine (``bench --engines`` times the engine's own load).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from pearl_hpc.bench import record
from pearl_hpc.core.weightcost import Links, sync_cost
from pearl_hpc.engine.rpc import new_key
from pearl_hpc.engine.store import KeyStore, StoreClient
from pearl_hpc.weights.group import WeightGroup, send_weights
from pearl_hpc.weights.shm import SharedStore, stage_private
from pearl_hpc.weights.wire import HASH_THREADS
from pearl_hpc.weights.wire import digest as version_digest

SIDE = 2048  # every tensor is SIDE x SIDE: 8 MiB in bf16
PER_LAYER = 4


def synthetic_state(gib: float) -> dict[str, torch.Tensor]:
    """fp32 tensors whose bf16 copy is about ``gib`` GiB, in transformer blocks."""
    layers = max(1, round(gib * 2**30 / (PER_LAYER * SIDE * SIDE * 2)))
    g = torch.Generator().manual_seed(0)
    return {
        f"model.layers.{i}.w{j}.weight": torch.randn(SIDE, SIDE, generator=g)
        for i in range(layers)
        for j in range(PER_LAYER)
    }


def digest(state: dict[str, torch.Tensor]) -> float:
    """A cheap fingerprint of the weights (the first row of every tensor, summed)."""
    return float(sum(t[0].float().sum() for t in state.values()))


def _engine(conn: Any) -> None:
    """The engine's side: receive each version into its file in shared memory and check
    its digest (as an engine does), or map it; then load it into parameters."""
    from pearl_hpc.engine.weightfile import receive_into_file
    from pearl_hpc.weights.shm import map_version

    params: dict[str, torch.Tensor] = {}
    host, port, key, prefix = conn.recv()
    # formed once, as for an epoch
    store = StoreClient(host, port, key)
    group = WeightGroup(store, prefix, rank=1, size=2)
    files = SharedStore.create("bench-engine")
    while (cmd := conn.recv()) is not None:
        how, args = cmd
        if how == "gloo":
            got = receive_into_file(group, store=files)
            if got.digest != args:
                raise SystemExit("bench --weights: the version does not match its digest")
            got.file.close()
            named = got.named
            if files is not None:
                files.unlink_before(got.version)
        else:
            _version, named = map_version(*args)
        delivered = time.time()
        for name, tensor in named:
            params.setdefault(name, torch.empty_like(tensor)).copy_(tensor)
        conn.send((delivered, time.time(), digest(params)))
        del named
    if files is not None:
        files.close()
    store.close()


def _measure(gib: float, repeats: int) -> dict[str, Any]:
    state = synthetic_state(gib)
    key = new_key()
    store = KeyStore(key)
    client = StoreClient(store.host, store.port, key)  # the trainer's side
    shared = SharedStore.create("bench")
    if shared is None:
        raise SystemExit("bench --weights: no /dev/shm on this machine")
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    engine = ctx.Process(target=_engine, args=(child,), daemon=True)
    engine.start()
    rows: dict[str, list[dict[str, float]]] = {"gloo": [], "shm": []}
    digests_s: list[float] = []  # the version's SHA-256: the sender's, each receiver's
    same = True  # every delivery left the engine with the trainer's bf16 weights
    try:
        conn.send((store.host, store.port, key, "bench/"))  # the pipe is the process's own
        group = WeightGroup(client, "bench/", 0, 2)
        for v in range(1, repeats + 1):
            t0 = time.time()
            staged = stage_private(state, v, torch.bfloat16, digest=True)
            t1 = time.time()
            assert staged.digest is not None
            conn.send(("gloo", staged.digest.result()))  # (hashed in the background)
            send_weights(group, staged.state, v)
            delivered, loaded, got = conn.recv()
            rows["gloo"].append(_row(t0, t1, delivered, loaded))
            same = same and got == digest(staged.state)
            t2 = time.perf_counter()  # the hash rate alone, untimed above
            version_digest(staged.state.items())
            digests_s.append(time.perf_counter() - t2)
            del staged

            t0 = time.time()
            mapped = shared.stage(state, v, torch.bfloat16)
            t1 = time.time()
            conn.send(("shm", (mapped.path, mapped.header)))
            delivered, loaded, got = conn.recv()
            rows["shm"].append(_row(t0, t1, delivered, loaded))
            same = same and got == digest(mapped.state)
            shared.unlink_before(v + 1)
    finally:
        conn.send(None)
        engine.join(timeout=30)
        shared.close()
        client.close()
        store.close()
    nbytes = sum(t.numel() * 2 for t in state.values())
    return {"bytes": nbytes, "tensors": len(state), "repeats": repeats, "runs": rows,
            "same_weights": same, "digest_s": statistics.median(digests_s)}  # fmt: skip


def _row(t0: float, staged: float, delivered: float, loaded: float) -> dict[str, float]:
    return {
        "stage_s": staged - t0,
        "deliver_s": delivered - staged,
        "load_s": loaded - delivered,
        "total_s": loaded - t0,
    }


def format_table(out: dict[str, Any]) -> str:
    med = {
        path: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for path, runs in out["runs"].items()
    }
    lines = [
        f"{out['bytes'] / 2**30:.2f} GiB of bf16 weights in {out['tensors']} tensors, "
        f"median of {out['repeats']}; the engine's weights the trainer's: {out['same_weights']}",
        f"{'':<10} {'gloo group':>12} {'shared memory':>14} {'shm / gloo':>11}",
    ]
    for key in ("stage_s", "deliver_s", "load_s", "total_s"):
        g, s = med["gloo"][key], med["shm"][key]
        lines.append(f"{key:<10} {g:>11.3f}s {s:>13.3f}s {s / g if g else float('nan'):>10.2f}x")
    rate = out["bytes"] / out["digest_s"] / 1e9
    lines.append(
        f"the version's SHA-256 alone (the sender's, once staged; a receiver hashes as it "
        f"copies): "
        f"{out['digest_s']:.3f}s, {rate:.2f} GB/s on {HASH_THREADS} threads"
    )
    return "\n".join(lines)


AT_SCALE = (("Qwen3-8B", 8.19e9), ("Qwen3-30B-A3B", 30.5e9))  # parameters (bf16 on the wire)


def at_scale_table(trainer_ranks: int = 16, tp: int = 2, links: Links | None = None) -> str:
    """One version's stages for Qwen3-8B and Qwen3-30B-A3B by arithmetic
    (:mod:`pearl_hpc.core.weightcost`), on PEARL's layout by default: 16 FSDP2 trainer
    ranks over 2 nodes, TP2 engines on other nodes."""
    links = links or Links()
    costs = [(name, 2 * params, sync_cost(2 * params, trainer_ranks, tp, links))
             for name, params in AT_SCALE]  # fmt: skip
    rows = [
        ("gather_s", "bf16 all-gather, every trainer rank"),
        ("to_host_s", "trainer 0: device -> pinned host (overlaps it)"),
        ("stage_s", "into the version's file in /dev/shm"),
        ("digest_s", "SHA-256 on trainer 0"),
        ("broadcast_s", "buckets: host -> device, NCCL, device -> /dev/shm"),
        ("verify_s", "SHA-256 on each node's lead engine"),
        ("load_s", "each engine reloads from its host copy"),
        ("trainer_s", "= the trainer's part (before the step's ack)"),
        ("publish_s", "= the publish (the engines generate meanwhile)"),
        ("pause_s", "= what an engine pauses for"),
        ("total_s", "= the step's last update to every engine serving it"),
    ]
    head = f"| stage ({trainer_ranks} trainer ranks, TP{tp} engines) | " + " | ".join(
        f"{name} ({w / 1e9:.1f} GB)" for name, w, _ in costs
    )
    lines = [head + " |", "|---|" + "---:|" * len(costs)]
    for key, what in rows:
        cells = " | ".join(f"{getattr(c, key):.2f} s" for _, _, c in costs)
        lines.append(f"| {what} | {cells} |")
    rates = ", ".join(
        f"{k} {v / 1e9:g} GB/s" for k, v in vars(links).items() if k != "hash_threads"
    )
    lines.append(f"\nrates: {rates}; SHA-256 on {links.hash_threads} threads")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pearl-hpc bench --weights", description=__doc__)
    parser.add_argument("--gib", type=float, default=1.0, help="bf16 size of the model")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--at-scale", action="store_true",
        help="print one version's stages for Qwen3-8B and 30B-A3B by arithmetic, run nothing",
    )  # fmt: skip
    record.add_argument(parser)
    args = parser.parse_args(argv)
    if args.at_scale:
        print(at_scale_table())
        return 0
    out = _measure(args.gib, args.repeats)
    runs = out["runs"]
    g, s = (statistics.median(r["total_s"] for r in runs[p]) for p in ("gloo", "shm"))
    ratios = {"shm / gloo total_s": s / g if g else 0.0}
    record.append(args.record, "weights", out, ratios, vars(args))
    print(json.dumps(out, indent=1) if args.json else format_table(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
