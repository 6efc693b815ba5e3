"""Per-rank memory and throughput of DDP vs FSDP2, with and without Mesa (gloo, CPU or GPU).

    python -m mesa_train.train.bench_distributed --out results/distributed

Each of the four settings runs in fresh processes (``--world`` ranks, spawned): a DeiT
(``--embed-dim``/``--depth``/``--img-size``) trains ``--warmup`` + ``--steps`` AdamW steps on
random data, each rank with its own batch. Per rank it measures exactly:

* ``params / grads / optimizer``: bytes this rank holds (its shards under FSDP), grads
  taken after backward, before ``zero_grad``;
* ``kept_for_backward``: activation bytes autograd keeps for one batch (the Mesa saving;
  DDP only: the meter cannot tell FSDP's gathered weights from activations);
* ``peak``: CUDA max allocated bytes on a GPU; on CPU the process's peak RSS growth
  (``ru_maxrss`` after the run minus before the model was built: allocator caching and the
  Python heap included, so it is coarse);
* ``images/s``: global images per second over the timed steps (warm-up excluded).

Writes ``table.md`` and ``rows.json`` under ``--out`` with the command line, and prints
the table; FSDP's ratios are against DDP with the same Mesa setting in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _worker(rank, world, port, args, strategy, mesa, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        row = _measure(rank, world, args, strategy, mesa, device)
        rows = [None] * world
        dist.all_gather_object(rows, row)
        if rank == 0:
            torch.save(rows, out)
    finally:
        dist.destroy_process_group()


def _measure(rank, world, args, strategy, mesa, device) -> dict:
    from mesa_train import patch_model
    from mesa_train.models import build_model
    from mesa_train.train.distributed import wrap_ddp
    from mesa_train.train.estimates import EstimateSync
    from mesa_train.train.fsdp import apply_fsdp, local_bytes, optimizer_state_tensors

    rss0 = _rss_bytes()
    torch.manual_seed(0)
    model = build_model("deit_ti", img_size=args.img_size, depth=args.depth, embed_dim=args.embed_dim,
                        num_heads=args.heads, patch_size=args.patch_size, num_classes=100)
    if mesa:
        model = patch_model(model)
    model.to(device)
    if strategy == "fsdp":
        wrapped = apply_fsdp(model)
    else:
        wrapped = wrap_ddp(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sync = EstimateSync(model)
    gen = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(args.batch, 3, args.img_size, args.img_size, device=device, generator=gen)
    y = torch.randint(0, 100, (args.batch,), device=device, generator=gen)
    grads = kept = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()
            start = time.perf_counter()
        if step == 0 and strategy == "ddp":
            from mesa_train.memory import SavedTensorMeter

            with SavedTensorMeter(model) as meter:
                loss = torch.nn.functional.cross_entropy(wrapped(x), y)
            kept = int(meter.activation_bytes)
        else:
            loss = torch.nn.functional.cross_entropy(wrapped(x), y)
        loss.backward()
        if grads is None:
            grads = local_bytes([p.grad for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync.sync()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _rss_bytes() - rss0
    return dict(strategy=strategy, mesa=mesa, rank=rank, params=local_bytes(model.parameters()), grads=grads,
                optimizer=local_bytes(optimizer_state_tensors(opt)), kept_for_backward=kept, peak=peak,
                peak_kind="cuda max allocated" if device.type == "cuda" else "peak RSS growth",
                images_per_s=args.batch * world * args.steps / seconds, loss=float(loss.detach()))


def _mib(v) -> str:
    return "-" if v is None else f"{v / 2**20:.2f}"


def table(rows: list[dict], command: str) -> str:
    base = {(r["mesa"], r["rank"]): r for r in rows if r["strategy"] == "ddp"}
    lines = [f"Command: `{command}`", "",
             f"Per rank, MiB ({rows[0]['peak_kind']} for `peak`); `x DDP`: FSDP2 / DDP with the same Mesa "
             "setting, this run.", "",
             "| strategy | Mesa | rank | params | grads | optimizer | state x DDP | kept_for_backward | peak | "
             "peak x DDP | images/s (all ranks) | images/s x DDP |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = base[(r["mesa"], r["rank"])]
        state = r["params"] + r["grads"] + r["optimizer"]
        b_state = b["params"] + b["grads"] + b["optimizer"]
        lines.append(
            f"| {r['strategy']} | {'on' if r['mesa'] else 'off'} | {r['rank']} | {_mib(r['params'])} | "
            f"{_mib(r['grads'])} | {_mib(r['optimizer'])} | {state / b_state:.2f} | {_mib(r['kept_for_backward'])} | "
            f"{_mib(r['peak'])} | {r['peak'] / b['peak']:.2f} | {r['images_per_s']:.1f} | "
            f"{r['images_per_s'] / b['images_per_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mesa_train.train.bench_distributed",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/distributed")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--embed-dim", type=int, default=192)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--img-size", type=int, default=64)
    p.add_argument("--patch-size", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = p.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        print(f"error: --device cuda needs {args.world} GPUs (one per rank), {torch.cuda.device_count()} visible",
              file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for mesa in (False, True):
        for strategy in ("ddp", "fsdp"):
            out = os.path.join(args.out, f".{strategy}-{int(mesa)}.pt")
            mp.start_processes(_worker, args=(args.world, _free_port(), args, strategy, mesa, out),
                               nprocs=args.world, join=True, start_method="spawn")
            rows += torch.load(out, weights_only=False)
            os.remove(out)
    command = "python -m mesa_train.train.bench_distributed " + " ".join(argv if argv is not None else sys.argv[1:])
    text = table(rows, command.strip())
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "rows.json"), "w") as f:
        json.dump({"command": command.strip(), "args": vars(args), "rows": rows}, f, indent=2)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
