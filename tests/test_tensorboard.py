"""The TensorBoard helper writes the step timer's and the counters' scalars into a real event file."""

from __future__ import annotations

import pytest

from cachefs import StepTimer
from cachefs.client.stats.jobstats import COLUMNS, CounterBlock, describe
from cachefs.client.stats.tensorboard import DATASET_SCALARS, write_scalars


def test_event_file_holds_the_scalars(tmp_path):
    SummaryWriter = pytest.importorskip("torch.utils.tensorboard").SummaryWriter
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    timer = StepTimer()
    for _ in timer(range(6)):
        pass
    block = CounterBlock(rows=2)
    values = [0] * len(COLUMNS)
    values[COLUMNS.index("samples")], values[COLUMNS.index("held_bytes")] = 6, 6000
    block.publish(1, values)
    writer = SummaryWriter(str(tmp_path))
    for step in (10, 20):
        written = write_scalars(writer, step, timer=timer, stats=describe(block.totals()))
    writer.close()
    acc = event_accumulator.EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {f"cachefs/data/{k}" for k in DATASET_SCALARS} <= tags
    assert {"cachefs/step/wait_share", "cachefs/step/steps", "cachefs/step/startup_s"} <= tags
    assert [(e.step, e.value) for e in acc.Scalars("cachefs/data/samples")] == [(10, 6.0), (20, 6.0)]
    assert [e.value for e in acc.Scalars("cachefs/step/steps")] == [5.0, 5.0] == [written["step/steps"]] * 2
    assert acc.Scalars("cachefs/data/held_bytes")[0].value == 6000.0
