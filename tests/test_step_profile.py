"""callbacks=profile: the profiled window is the steps asked for, and its files say what ran in them."""

from __future__ import annotations

import json
import re
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from disttrain.rank.host_reads import HostReads
from disttrain.rank.step_profile import StepProfiler, busy_us


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(tmp_path, profiler: StepProfiler, max_steps: int, accumulate: int = 1) -> None:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=generator), torch.randn(64, 1, generator=generator))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[profiler],
                         accumulate_grad_batches=accumulate, default_root_dir=tmp_path)
    trainer.fit(Regression(), DataLoader(data, batch_size=4))


def calls(table: str, name: str) -> int:
    """The '# of Calls' column of ``name``'s row in a profiler table."""
    row = next(line for line in table.splitlines() if line.strip().startswith(name))
    return int(row.split()[-1])


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_window_holds_the_optimiser_steps_asked_for(tmp_path, capsys, accumulate):
    profiler = StepProfiler(start_step=3, steps=2)
    fit(tmp_path, profiler, max_steps=8, accumulate=accumulate)
    table = (tmp_path / "profile" / "rank0_ops.txt").read_text()
    assert calls(table, "Optimizer.step#SGD.step") == 2
    assert calls(table, "aten::mse_loss ") == 2 * accumulate  # every micro-batch of both steps
    trace = json.loads((tmp_path / "profile" / "rank0_trace.json").read_text())
    assert any(event.get("name") == "aten::addmm" for event in trace["traceEvents"])
    assert profiler.summary["steps"] == 2 and profiler.summary["step_ms"] > 0
    assert "device_ms" not in profiler.summary  # a CPU fit has no device time to report
    assert "profile of steps 4-5: " in capsys.readouterr().out


def test_a_fit_that_ends_inside_the_window_writes_what_ran(tmp_path):
    profiler = StepProfiler(start_step=2, steps=10, dirpath=str(tmp_path / "here"), with_stack=True)
    fit(tmp_path, profiler, max_steps=5)
    assert profiler.summary["steps"] == 3
    assert calls((tmp_path / "here" / "rank0_ops.txt").read_text(), "Optimizer.step#SGD.step") == 3
    # with_stack: the timeline names the Python line that ran each operator (here the module's training_step),
    # and the stacks table puts the host's time on the lines that spent it
    assert "training_step" in (tmp_path / "here" / "rank0_trace.json").read_text()
    stacks = (tmp_path / "here" / "rank0_host_stacks.txt").read_text()
    assert "Source Location" in stacks and "test_step_profile.py" in stacks, stacks[:2000]
    width = len(stacks.splitlines()[0].split()[0])  # the Name column's, as its rule of dashes
    names = [line[:width].strip() for line in stacks.splitlines()[3:] if line[:width].strip()]
    assert "aten::addmm" in names and not [name for name in names if re.search(r"\(\d+\): ", name)], names
    assert not (tmp_path / "here" / "rank0_host_ops.txt").exists()  # on a CPU the ops table is the host's already


def test_a_window_that_cannot_open_is_refused_by_its_values():
    with pytest.raises(ValueError, match="start_step=-1 and steps=0"):
        StepProfiler(start_step=-1, steps=0)


def test_the_device_busy_time_is_the_union_of_its_spans():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(start, end, device=DeviceType.CUDA, annotation=False):
        return SimpleNamespace(time_range=SimpleNamespace(start=start, end=end), device_type=device,
                               is_user_annotation=annotation)

    events = [event(0, 10), event(5, 12), event(20, 25), event(30, 31, annotation=True), event(0, 100, DeviceType.CPU)]
    assert busy_us(events) == 17  # 0-12 and 20-25: overlapping streams once, no host op or annotation


def read_value() -> None:
    # what torch's sync debug mode warns on a synchronising call, from this frame
    warnings.warn(f"called a synchronizing CUDA operation ({HostReads.__name__} test)", UserWarning, stacklevel=1)


def test_host_reads_are_counted_by_the_line_that_made_them_and_other_warnings_pass(recwarn):
    reads = HostReads()
    reads.start(cuda=False)
    for _ in range(3):
        read_value()
    warnings.warn("an unrelated warning", UserWarning, stacklevel=1)
    reads.stop()
    read_value()  # after stop: not recorded
    assert reads.total == 3
    (stack,) = reads.counts
    assert stack[0].endswith(" in read_value") and "test_step_profile.py" in stack[0]
    assert "test_host_reads_are_counted" in stack[1]
    assert [str(w.message) for w in recwarn] == ["an unrelated warning",
                                                  "called a synchronizing CUDA operation (HostReads test)"]
    assert reads.table(steps=3).startswith("3 synchronising CUDA calls in 3 steps (1.0 a step)")
