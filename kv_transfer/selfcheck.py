"""Two-process check of the torch.distributed transport on this machine, no Ray:

    python -m tandem.kv_transfer.selfcheck --device cuda     # NCCL data + gloo control; needs 2 GPUs
    python -m tandem.kv_transfer.selfcheck --device cpu      # gloo only

Moves a Llama-shaped cache (default: Llama-3.1-8B KV, bf16, 16-token blocks) layer by layer from a
sender process to a receiver process into different, shuffled block ids; checks every byte; times
each transfer; then aborts one from the receiver, kills the sender mid-transfer, starts a new
sender under the same id and checks the pair reconnects. Prints a table; `--out` writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from tandem.kv_transfer.spec import TransferSpec
from tandem.kv_transfer.config import KVTransferConfig
from tandem.kv_transfer.testing import TensorBlockStore
from tandem.kv_transfer.torch_dist import (backend_for, make_dist_receiver, make_dist_sender,
                                           start_rendezvous_store)

CONFIG = KVTransferConfig(timeout_s=10.0, start_timeout_s=60.0, connect_timeout_s=60.0)
SEED = 1234


def _store(args: argparse.Namespace, device: str, seed: int | None) -> TensorBlockStore:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return TensorBlockStore(args.layers, 2 * args.blocks, args.block_size, args.heads, args.head_dim,
                            dtype=getattr(torch, args.dtype), device=device, generator=gen)


def _spec(args: argparse.Namespace, rid: str, n_layers: int | None = None) -> TransferSpec:
    g = torch.Generator().manual_seed(hash(rid) % 2**31)
    src = torch.randperm(2 * args.blocks, generator=g)[:args.blocks].tolist()
    dst = torch.randperm(2 * args.blocks, generator=g)[:args.blocks].tolist()
    return TransferSpec(rid, "prefill-0", "decode-0", tuple(range(n_layers or args.layers)),
                        src, dst, num_tokens=args.blocks * args.block_size)


def _sender_main(addr: str, args: argparse.Namespace, device: str, cmds: Any, out: Any) -> None:
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    released: list[str] = []
    sender = make_dist_sender("prefill-0", _store(args, device, SEED), addr, CONFIG, released.append)
    while (cmd := cmds.get()) is not None:
        spec = TransferSpec.from_msg(cmd["spec"])
        t0 = time.perf_counter()
        sender.begin(spec)
        for i, layer in enumerate(spec.layers):
            if cmd.get("die_after") == i:
                while sender.progress(spec.request_id)[0] < i:
                    time.sleep(0.001)
                os._exit(1)                              # a crash: no cleanup, no goodbye
            time.sleep(cmd.get("delay", 0.0))
            sender.send_layer(spec.request_id, layer)
        try:
            state = sender.wait(spec.request_id, 120).value
        except Exception as exc:
            state = type(exc).__name__
        sender.reap()
        out.put({"rid": spec.request_id, "state": state, "seconds": time.perf_counter() - t0,
                 "released": released.count(spec.request_id)})


def _receiver_main(addr: str, args: argparse.Namespace, device: str, cmds: Any, out: Any) -> None:
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    released: list[str] = []
    store = _store(args, device, None)
    reference = _store(args, "cpu", SEED)               # what the sender holds
    receiver = make_dist_receiver("decode-0", store, addr, CONFIG, released.append)
    while (cmd := cmds.get()) is not None:
        reply: dict[str, Any] = {}
        if cmd["op"] == "expect":
            receiver.expect(TransferSpec.from_msg(cmd["spec"]))
        elif cmd["op"] == "wait":
            spec = TransferSpec.from_msg(cmd["spec"])
            t0 = time.perf_counter()
            try:
                reply["state"] = receiver.wait(spec.request_id, cmd["timeout"]).value
            except Exception as exc:
                reply["state"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            reply["seconds"] = time.perf_counter() - t0
            if reply["state"] == "done":
                reply["exact"] = all(torch.equal(
                    store.gather_blocks(layer, list(spec.dst_block_ids)).cpu(),
                    reference.gather_blocks(layer, list(spec.src_block_ids)))
                    for layer in spec.layers)
        elif cmd["op"] == "abort_after":
            while receiver.progress(cmd["rid"])[0] < cmd["layers"]:
                time.sleep(0.001)
            receiver.abort(cmd["rid"])
            reply["state"] = receiver.poll(cmd["rid"]).value
        receiver.reap()
        rid = cmd["rid"] if "rid" in cmd else cmd["spec"]["request_id"]
        reply["released"] = released.count(rid)
        out.put(reply)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    devices = ("cuda:0", "cuda:1") if args.device == "cuda" else ("cpu", "cpu")
    store, port = start_rendezvous_store("127.0.0.1")   # kept alive until the checks are done
    results: dict[str, Any] = {"backend": backend_for(devices[0]), "torch": torch.__version__,
                               "args": vars(args), "transfers": []}
    layer_bytes = (args.blocks * 2 * args.block_size * args.heads * args.head_dim
                   * torch.empty(0, dtype=getattr(torch, args.dtype)).element_size())
    _run_checks(args, f"127.0.0.1:{port}", devices, layer_bytes, results)
    _print(results, layer_bytes)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)
    ok = (all(t["receiver"].get("exact") for t in results["transfers"])
          and results["abort"]["receiver"]["state"] == "aborted"
          and results["abort"]["receiver"]["released"] == 1 and results["abort"]["sender"]["released"] == 1
          and results["kill"]["receiver"]["state"] != "done" and results["kill"]["receiver"]["released"] == 1
          and results["after_restart"]["receiver"].get("exact"))
    print("SELFCHECK", "OK" if ok else "FAILED")
    return 0 if ok else 1


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--blocks", type=int, default=256, help="blocks per transfer (256 x 16 = 4k tokens)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def _run_checks(args: argparse.Namespace, addr: str, devices: tuple[str, str], layer_bytes: int,
                results: dict[str, Any]) -> None:
    """Timed transfers, an abort from the receiver, a sender killed mid-transfer and one started
    again under the same id, between two spawned processes; their outcomes go into `results`."""
    ctx = mp.get_context("spawn")
    r_cmd, r_out, s_cmd, s_out = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    recv_p = ctx.Process(target=_receiver_main, args=(addr, args, devices[1], r_cmd, r_out))
    send_p = ctx.Process(target=_sender_main, args=(addr, args, devices[0], s_cmd, s_out))
    recv_p.start()
    send_p.start()

    def transfer(rid: str, **sender_opts: Any) -> dict[str, Any]:
        spec = _spec(args, rid).to_msg()
        r_cmd.put({"op": "expect", "spec": spec})
        r_out.get(timeout=120)
        s_cmd.put({"spec": spec, **sender_opts})
        r_cmd.put({"op": "wait", "spec": spec, "timeout": 120})
        return {"rid": rid, "receiver": r_out.get(timeout=180),
                "sender": s_out.get(timeout=180) if "die_after" not in sender_opts else None}

    try:
        for i in range(args.repeats):
            res = transfer(f"t{i}")
            res["GB/s"] = round(layer_bytes * args.layers / res["sender"]["seconds"] / 1e9, 2)
            results["transfers"].append(res)
        spec = _spec(args, "aborted").to_msg()
        r_cmd.put({"op": "expect", "spec": spec})
        r_out.get(timeout=120)
        s_cmd.put({"spec": spec, "delay": 0.05})
        r_cmd.put({"op": "abort_after", "rid": "aborted", "layers": 2})
        results["abort"] = {"receiver": r_out.get(timeout=120), "sender": s_out.get(timeout=120)}
        results["kill"] = transfer("killed", die_after=3)
        send_p.join(30)
        send_p = ctx.Process(target=_sender_main, args=(addr, args, devices[0], s_cmd, s_out))
        send_p.start()
        results["after_restart"] = transfer("after-restart")
    finally:
        r_cmd.put(None)
        s_cmd.put(None)
        for proc in (recv_p, send_p):
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def _print(results: dict[str, Any], layer_bytes: int) -> None:
    a = results["args"]
    print(f"backend {results['backend']}  torch {results['torch']}  {a['layers']} layers x "
          f"{layer_bytes / 2**20:.1f} MiB/layer ({a['blocks']} blocks)")
    for t in results["transfers"]:
        print(f"  {t['rid']:<14} sender {t['sender']['seconds'] * 1e3:8.1f} ms  {t['GB/s']:7.2f} GB/s  "
              f"exact={t['receiver'].get('exact')}")
    print(f"  abort      receiver {results['abort']['receiver']}  sender {results['abort']['sender']}")
    print(f"  kill       receiver {results['kill']['receiver']}")
    print(f"  restart    receiver {results['after_restart']['receiver']}")


if __name__ == "__main__":
    raise SystemExit(main())
