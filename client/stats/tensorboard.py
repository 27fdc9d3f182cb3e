"""TensorBoard scalars of the step timer and a dataset's client counters (optional: tensorboard).

    from torch.utils.tensorboard import SummaryWriter
    writer = SummaryWriter("runs/job")
    for step, batch in enumerate(timer(loader)):
        ...
        if step % 100 == 0:
            cachefs.client.stats.tensorboard.write_scalars(writer, step, timer=timer, dataset=ds)

Only ``writer.add_scalar(tag, value, step)`` is used, so any SummaryWriter-like object works;
nothing here imports tensorboard (``pip install 'cachefs[tensorboard]'`` for torch's writer).
"""

from __future__ import annotations

from typing import Any, Protocol

from cachefs.client.stats.steptimer import StepTimer

#: The dataset counters written (the rest of ds.stats() is for the report, not for curves).
DATASET_SCALARS = ("samples", "wait_s", "bytes", "reads", "short_circuit_bytes", "held_bytes", "data_port_bytes",
                   "grpc_bytes", "store_bytes", "hits", "misses", "hit_ratio", "lean_fallbacks", "failovers",
                   "errors", "hints_sent", "hints_answered", "prefetch_hits", "prefetch_on_demand",
                   "prefetch_in_flight", "prefetch_in_flight_bytes", "max_prefetch_in_flight_bytes")


class ScalarWriter(Protocol):
    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> Any: ...


def scalars(timer: StepTimer | None = None, dataset: Any = None, stats: dict[str, Any] | None = None
            ) -> dict[str, float]:
    """The tags and values ``write_scalars`` writes: ``step/*`` from the timer, ``data/*`` from
    the dataset's ``stats()`` (or ``stats`` given)."""
    out: dict[str, float] = {}
    if timer is not None:
        out.update({f"step/{k}": float(v) for k, v in timer.summary().scalars().items()})
    if stats is None and dataset is not None:
        stats = dataset.stats()
    if stats is not None:
        out.update({f"data/{k}": float(stats[k]) for k in DATASET_SCALARS if k in stats})
    return out


def write_scalars(writer: ScalarWriter, step: int, *, timer: StepTimer | None = None, dataset: Any = None,
                  stats: dict[str, Any] | None = None, prefix: str = "cachefs") -> dict[str, float]:
    """Write the scalars under ``prefix/`` at ``step``; returns what was written."""
    values = scalars(timer, dataset, stats)
    for tag, value in values.items():
        writer.add_scalar(f"{prefix}/{tag}", value, step)
    return values
