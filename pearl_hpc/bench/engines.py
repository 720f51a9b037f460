"""Engine-side costs on real vLLM: start, role change, weight load, activation and
deactivation, memory, and generation throughput colocated vs disaggregated side by side.

    pearl-hpc bench --engines [--model DIR] [--requests 32] [--prompt-tokens 256]

Two engine worker processes are measured at a time (as in the tests):
- **colocated**: 2 colocated workers, requests split least-loaded;
- **disaggregated**: 1 prefill + 1 decode worker, every request prefilled on one, its KV
  pulled over NIXL by the other, decoded there.
Same requests (greedy, fixed prompt and output lengths), same number of processes. On a
2-core machine both processes share the cores, so this shows the mechanism's overhead,
not PEARL's GPU-scale gain (where prefill and decode run on separate devices).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pearl_hpc.bench import record
from pearl_hpc.core.types import Mode, Role
from pearl_hpc.engine.client import WorkerProcess, spawn_worker
from pearl_hpc.engine.rpc import new_key
from pearl_hpc.engine.spec import EngineSpec
from pearl_hpc.engine.tinymodel import build_tiny_model, default_model_dir
from pearl_hpc.engine.types import TurnRequest
from pearl_hpc.rollout.router import Router


def _requests(num: int, prompt_tokens: int, max_tokens: int, seed: int) -> list[TurnRequest]:
    rng = random.Random(seed)
    return [
        TurnRequest(
            f"r{i}", tuple(rng.randrange(10, 1000) for _ in range(prompt_tokens)), max_tokens
        )
        for i in range(num)
    ]


async def _throughput(router: Router, requests: list[TurnRequest]) -> dict[str, float]:
    t0 = time.perf_counter()
    routed = await asyncio.gather(*[router.generate(r.request_id, r) for r in requests])
    wall_s = time.perf_counter() - t0
    generated = sum(len(x.result.token_ids) for x in routed)
    return {"wall_s": wall_s, "generated_tokens": generated, "tokens_per_s": generated / wall_s}


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = args.model or str(build_tiny_model(default_model_dir()))
    spec = EngineSpec(model_dir=model_dir)
    key = new_key()
    out: dict[str, Any] = {"model": model_dir}
    with tempfile.TemporaryDirectory(prefix="pearl-bench-engines-") as tmp:
        run_dir = Path(tmp)
        t0 = time.perf_counter()
        a, b = await asyncio.gather(
            spawn_worker(spec, "a", run_dir=run_dir, key=key, role=Role.COLOCATED, slot_id=0),
            spawn_worker(spec, "b", run_dir=run_dir, key=key, role=Role.COLOCATED, slot_id=1),
        )
        out["process_start_s"] = time.perf_counter() - t0
        workers: list[WorkerProcess] = [a, b]
        try:
            out["engine_start_s"] = [w.start_s for w in workers]
            requests = _requests(args.requests, args.prompt_tokens, args.max_tokens, args.seed)
            await a.client.generate(TurnRequest("warm", requests[0].prompt_token_ids, 4))

            runs: dict[str, list[dict[str, float]]] = {"colocated": [], "disaggregated": []}
            for rep in range(args.repeats):
                colocated = Router()
                colocated.set_workers(
                    {"a": a.client, "b": b.client},
                    {"a": Role.COLOCATED, "b": Role.COLOCATED},
                    Mode.COLOCATED,
                )
                runs["colocated"].append(
                    await _throughput(colocated, [_renamed(r, f"c{rep}") for r in requests])
                )
                role_a = await a.client.set_role(Role.PREFILL)
                role_b = await b.client.set_role(Role.DECODE)
                for timing in (role_a, role_b):  # restarts the first time (as kv_both),
                    # in place afterwards
                    kind = "role_in_place_s" if timing.detail.get("in_place") else "role_restart_s"
                    out.setdefault(kind, []).append(timing.wall_s)
                disagg = Router()
                disagg.set_workers(
                    {"a": a.client, "b": b.client},
                    {"a": Role.PREFILL, "b": Role.DECODE},
                    Mode.DISAGGREGATED,
                )
                # the first PD turn of a new engine pair pays the NIXL handshake: timed
                # apart, so the throughput rows compare steady states
                t_first = time.perf_counter()
                await disagg.generate("warm", _renamed(requests[0], f"w{rep}"))
                out.setdefault("pd_first_turn_s", []).append(time.perf_counter() - t_first)
                kv_before = (await b.client.stats()).kv_bytes_received
                runs["disaggregated"].append(
                    await _throughput(disagg, [_renamed(r, f"d{rep}") for r in requests])
                )
                runs["disaggregated"][-1]["kv_bytes"] = (
                    await b.client.stats()
                ).kv_bytes_received - kv_before
                await a.client.set_role(Role.COLOCATED)
                await b.client.set_role(Role.COLOCATED)
            out["throughput"] = runs

            blob = Path(model_dir, "model.safetensors").read_bytes()
            loads = [(await a.client.load_weights(v + 1, data=blob)).wall_s for v in range(3)]
            out["weight_load_s"] = loads
            out["weights_bytes"] = len(blob)
            deacts, acts = [], []
            for _ in range(2):
                timing, _partial = await b.client.deactivate()
                deacts.append(timing.wall_s)
                out["rss_released_bytes"] = (await b.client.stats()).rss_bytes
                acts.append((await b.client.activate(Role.COLOCATED, blob, 9)).wall_s)
            out["deactivate_s"], out["activate_s"] = deacts, acts
            out["rss_serving_bytes"] = (await b.client.stats()).rss_bytes
        finally:
            await asyncio.gather(*[w.stop() for w in workers], return_exceptions=True)
    return out


def _renamed(r: TurnRequest, prefix: str) -> TurnRequest:
    from dataclasses import replace

    return replace(r, request_id=f"{prefix}-{r.request_id}")


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def table_rows(out: dict[str, Any]) -> list[tuple[str, str]]:
    """(what, measured) of one run: medians over the repeats; the throughput and the KV
    pulled per repeat too."""
    tp = out["throughput"]
    col = _median([r["tokens_per_s"] for r in tp["colocated"]])
    dis = _median([r["tokens_per_s"] for r in tp["disaggregated"]])

    def each(mode: str, key: str, scale: float, fmt: str) -> str:
        return " / ".join(format(r[key] / scale, fmt) for r in tp[mode])

    return [
        (
            "engine start, first in a process (imports vLLM), 2 at once",
            f"{_median(out['engine_start_s']):.2f} s",
        ),
        (
            "role change of a plain colocated engine to PD (drain + stop + start as kv_both)",
            f"{_median(out.get('role_restart_s', [])):.2f} s",
        ),
        (
            "role change of a kv_both engine (in place)",
            f"{_median(out.get('role_in_place_s', [])) * 1000:.1f} ms",
        ),
        (
            "weight load, version-tagged (reload_weights + prefix-cache reset)",
            f"{_median(out['weight_load_s']) * 1000:.0f} ms"
            f" for {out['weights_bytes'] / 1e6:.1f} MB",
        ),
        ("deactivate (drain, partials returned, release)", f"{_median(out['deactivate_s']):.2f} s"),
        ("activate (restore + weights + admit)", f"{_median(out['activate_s']):.2f} s"),
        (
            "memory per engine process (RSS), serving / released",
            f"{out['rss_serving_bytes'] / 2**30:.2f} / {out['rss_released_bytes'] / 2**30:.2f} GiB",
        ),
        (
            "first PD turn of a new prefill/decode pair (NIXL handshake)",
            f"{_median(out['pd_first_turn_s']):.2f} s",
        ),
        (
            "tokens/s colocated (2 colocated workers), each repeat",
            each("colocated", "tokens_per_s", 1, ".0f"),
        ),
        (
            "tokens/s disaggregated (1 prefill + 1 decode), each repeat",
            each("disaggregated", "tokens_per_s", 1, ".0f") + f" (x{dis / col:.2f} of colocated)",
        ),
        (
            "KV pulled over NIXL per batch, each repeat",
            each("disaggregated", "kv_bytes", 1e6, ".1f") + " MB",
        ),
    ]


def format_table(out: dict[str, Any]) -> str:
    rows = table_rows(out)
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pearl-hpc bench --engines", description=__doc__)
    parser.add_argument("--model", help="model directory (default: build the tiny model)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    record.add_argument(parser)
    args = parser.parse_args(argv)
    out = asyncio.run(_measure(args))
    tp = out["throughput"]
    col = _median([r["tokens_per_s"] for r in tp["colocated"]])
    dis = _median([r["tokens_per_s"] for r in tp["disaggregated"]])
    record.append(args.record, "engines", out, {"1P1D / 2C tokens/s": dis / col}, vars(args))
    print(json.dumps(out, indent=1) if args.json else format_table(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
