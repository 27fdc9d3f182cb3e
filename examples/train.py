"""Train a small model on data read through cachefs, following the tuning rules of the design brief.

    # against a running cluster, a prefix of 256 KiB samples:
    python examples/train.py --master cachefs-master:19998 --data cachefs://datasets/train/
    # or self-contained: a local cluster (master + 2 workers) over a generated dataset
    python examples/train.py --local --samples 2000 --epochs 3

The rules it applies (and prints):
* asynchronous loading: ``num_workers > 0`` DataLoader processes, each prefetching its next
  samples in the order the sampler will ask for them (CacheDataset knows the epoch order);
* tensors without extra copies: the dataset hands out aligned uint8 tensors (one memcpy),
  decoded on the device after the copy (``uint8`` crosses PCIe, 4x fewer bytes than float32);
* ``pin_memory=True`` and ``.to(device, non_blocking=True)`` when the device is a GPU (on the
  CPU both are skipped: pinning needs a GPU and non_blocking is a no-op);
* exact resume: ``state_dict()`` of the dataset saved with the model (``--checkpoint``).

Per epoch it prints samples/s and the share of the steps the loop spent waiting for data (the
data stall, measured by ``cachefs.StepTimer``; a well-fed GPU job keeps it under a few percent),
and at the end the timer's report and the client counters of all DataLoader workers (``ds.stats()``).
With ``--tensorboard DIR`` it also writes those numbers as TensorBoard scalars every
``--log-every`` steps (``cachefs.client.stats.tensorboard``; needs ``pip install 'cachefs[tensorboard]'``);
``examples/tensorboard_png.py DIR out.png`` draws them without a browser.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

FEATURES = 4096  # bytes of each sample the model looks at
CLASSES = 10


def decode_on_device(batch: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 samples -> (features, labels), after the copy: the label is byte 8 of the sample."""
    batch = batch.to(device, non_blocking=device.type == "cuda")
    x = batch[:, 16:16 + FEATURES].float().div_(255.0)
    y = batch[:, 8].long() % CLASSES
    return x, y


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, CLASSES))


@contextlib.contextmanager
def local_cluster(samples: int, size: int, workdir: str) -> Iterator[tuple[str, str]]:
    """A master and two workers as processes over ``samples`` generated files (the --local mode)."""
    from cachefs.local import LocalCluster

    data = os.path.join(workdir, "dataset")
    os.makedirs(data, exist_ok=True)
    noise = os.urandom(size)
    for i in range(samples):
        path = os.path.join(data, f"{i:06d}.bin")
        if not os.path.exists(path):
            with open(path, "wb") as f:  # bytes 0-7: the index; byte 8: the label
                f.write(f"{i:08d}".encode() + bytes([i % CLASSES]) + noise[9:])
    with LocalCluster(os.path.join(workdir, "cluster"), workers=2, mounts={"train": data}, quota="4GiB") as cluster:
        if not cluster.wait_for_workers():
            raise RuntimeError("the local cluster's workers did not join in time")
        yield cluster.master_address, "cachefs://train/"


def train(master: str, data: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from cachefs import CacheDataset, StepTimer

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    ds = CacheDataset.from_prefix(data, storage_options={"master": master}, seed=args.seed,
                                  prefetch_bytes=args.prefetch_mib << 20)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=ds.sampler(), num_workers=args.num_workers,
                        pin_memory=on_gpu, prefetch_factor=4 if args.num_workers else None,
                        timeout=300 if args.num_workers else 0)
    model = make_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    start_epoch = 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        ds.load_state_dict(saved["data"])
        start_epoch = ds.epoch
        print(f"resumed at epoch {start_epoch}, sample {saved['data']['samples_seen']} of {len(ds)}")
    print(f"device {device} | {len(ds)} samples | num_workers {args.num_workers} | pin_memory {on_gpu} | "
          f"non_blocking {on_gpu} | batch {args.batch_size}")
    report = []
    timer = StepTimer()  # data wait vs compute per step (client/stats/steptimer.py)
    writer = None
    if args.tensorboard:
        from torch.utils.tensorboard import SummaryWriter  # the optional extra: cachefs[tensorboard]

        from cachefs.client.stats.tensorboard import write_scalars
        writer = SummaryWriter(args.tensorboard)
    step = 0
    for epoch in range(start_epoch, args.epochs):
        ds.set_epoch(epoch)
        t0 = time.perf_counter()
        mark = timer.mark()  # this epoch's steps: summary(since=mark)
        n = 0
        loss = torch.zeros(())
        for batch in timer(ds.track(loader), loader=loader):
            x, y = decode_on_device(batch, device)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if on_gpu:
                loss.item()  # waits for the GPU: its time shows as compute, not as the next batch's wait
            n += len(batch)
            step += 1
            if writer is not None and step % args.log_every == 0:
                write_scalars(writer, step, timer=timer, dataset=ds)  # ds.stats(): every DataLoader worker
            if args.checkpoint and n % (args.batch_size * args.checkpoint_every) == 0:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "data": ds.state_dict()},
                           args.checkpoint)
        if on_gpu:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        share = timer.summary(since=mark).wait_share  # after the epoch's first batch
        row = {"epoch": epoch, "samples": n, "samples_per_s": n / seconds, "data_wait_share": share,
               "loss": float(loss.detach())}
        report.append(row)
        print(f"epoch {epoch}: {n} samples in {seconds:.2f} s = {row['samples_per_s']:.0f} samples/s; "
              f"waiting for data {100 * share:.1f}% of the steps after the first; loss {row['loss']:.3f}",
              flush=True)
    if writer is not None:
        write_scalars(writer, step, timer=timer, dataset=ds)
        writer.close()
    print(timer.report())
    stats = ds.stats()  # summed over the DataLoader workers (client/stats/jobstats.py)
    print(f"cachefs: {stats['samples']} samples, {stats['bytes'] / 1e6:.1f} MB in {stats['reads']} reads "
          f"(held handles {stats['held_bytes'] / 1e6:.1f} MB, short-circuit {stats['short_circuit_bytes'] / 1e6:.1f} MB, "
          f"data port {stats['data_port_bytes'] / 1e6:.1f} MB, gRPC {stats['grpc_bytes'] / 1e6:.1f} MB, "
          f"store {stats['store_bytes'] / 1e6:.1f} MB); pages {stats['hits']} hits, {stats['misses']} misses "
          f"(as the workers knew them); {stats['failovers']} failovers, {stats['errors']} errors; "
          f"{stats['wait_s']:.2f} s reading in DataLoader workers", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--master", help="the cachefs master, host:port")
    p.add_argument("--data", help="cachefs:// prefix of the samples (>= 4,112 bytes each)")
    p.add_argument("--local", action="store_true", help="run a local cluster over a generated dataset")
    p.add_argument("--samples", type=int, default=2000, help="--local: number of samples")
    p.add_argument("--sample-size", type=int, default=256 << 10, help="--local: bytes per sample")
    p.add_argument("--workdir", help="--local: where the dataset and cluster live (default: a temp dir)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--num-workers", type=int, default=min(8, os.cpu_count() or 2))
    p.add_argument("--prefetch-mib", type=int, default=64, help="prefetch bound per DataLoader worker")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", help="save model + data position here every --checkpoint-every batches; "
                                        "resume from it when it exists")
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--tensorboard", help="write StepTimer and ds.stats() scalars here (a TensorBoard log dir)")
    p.add_argument("--log-every", type=int, default=5, help="steps between TensorBoard writes")
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    if args.local:
        with tempfile.TemporaryDirectory(prefix="cachefs-train-") as tmp, \
                local_cluster(args.samples, args.sample_size, args.workdir or tmp) as (master, data):
            train(master, data, args)
        return 0
    if not (args.master and args.data):
        p.error("give --master and --data, or --local")
    train(args.master, args.data, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
