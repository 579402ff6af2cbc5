"""callbacks=memory: one step's memory, change by change; its peak is results.json's, its holders sum to it, and
its options are checked before ranks start."""

from __future__ import annotations

import gc
import json
import threading

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from disttrain.config.validation import validate
from disttrain.errors import ConfigError
from disttrain.observe.cuda_step import add_trace
from disttrain.observe.memory_callback import StepMemoryCallback
from disttrain.observe.memory_options import check_memory_callbacks
from disttrain.observe.memory_timeline import Holder, MemoryEvent, StepTimeline
from disttrain.observe.tensor_bytes import LiveStorages
from tests.conftest import ROOT, train_cli_in_process

RUN = ["model=gpt", "model.flavour=micro", "data=pydocs", "data.block_size=8", "batch.global_size=2",
       "trainer.max_steps=3", "trainer.limit_val_batches=0", "trainer.run_test=false", "logger=none",
       "callbacks=memory", "callbacks.memory.step=1", "checkpoint.save_last=false", "checkpoint.save_top_k=0",
       "energy=false"]
"""A tiny run recording its second step (the optimiser's state exists by then, as in every later step). Its
micro-batches are so small that the parameters outweigh the activations: under ZeRO-3 the peak comes while FSDP2
holds a unit gathered, in storages it resizes rather than allocates."""


def recorded(tmp_path, *args: str) -> tuple[dict, dict, str]:
    """results.json, rank 0's ``logs/memory_step.json`` and the run's output."""
    result = train_cli_in_process([*RUN, *args, f"hydra.run.dir={tmp_path}"], ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    return results, json.loads((tmp_path / "logs" / "memory_step.json").read_text()), result.stdout


def check_record(results: dict, record: dict) -> None:
    """The record's peak, summed from its list of changes, is the counter's own peak in results.json, and the
    tensors alive at the peak add up to it."""
    assert record["peak_bytes"] == results["memory"]["recorded_step"]["peak_bytes"]
    live = [record["start_bytes"], *record["timeline"]["live_bytes"]]
    assert max(live) == record["peak_bytes"] == live[record["peak_after_events"]]
    held: dict[int, int] = {}
    for event, (holder, delta) in enumerate(zip(record["timeline"]["holder"], record["timeline"]["delta_bytes"],
                                                strict=True)):
        if event == record["peak_after_events"]:
            break
        held[holder] = held.get(holder, 0) + delta
    start = record["start_bytes"]
    assert start + sum(held.values()) == record["peak_bytes"]
    assert {span["phase"] for span in record["phases"]} == {"forward", "backward", "optimiser"}
    top = record["largest_at_peak"]
    assert top and top == sorted(top, key=lambda holder: -holder["bytes_at_peak"])


def resized_from_start(record: dict) -> int:
    """Bytes the record shows storages alive before the step grow by (FSDP2 filling its gathered parameters)."""
    start = {number for number, holder in enumerate(record["holders"]) if holder["phase"] == "start"}
    return sum(delta for holder, delta in zip(record["timeline"]["holder"], record["timeline"]["delta_bytes"],
                                              strict=True) if holder in start and delta > 0)


def test_one_rank_records_its_step_with_the_peak_results_json_reports(tmp_path):
    # ZeRO-3 on one rank: FSDP2 still gathers into storages it resizes, which the record must follow
    results, record, out = recorded(tmp_path, "parallel=zero3", "plots=true")
    check_record(results, record)
    assert resized_from_start(record) > 0
    assert record["step"] == 1 and record["rank"] == 0
    # the moments come in the step's order, and the plan's are beside them
    moments = record["moments_after_events"]
    assert moments["after_forward"] <= moments["after_backward"] <= moments["after_step"] == record["events"]
    assert set(record["planned_moments_bytes"]) >= {"after_forward", "after_backward"}
    # what blocks make is named by the block's module, in forward and in backward, at the peak too
    made = {(holder["module"].partition(".blocks.")[1], holder["phase"]) for holder in record["holders"]}
    assert {(".blocks.", "forward"), (".blocks.", "backward")} <= made, made
    assert any(".blocks." in holder["module"] for holder in record["largest_at_peak"]), record["largest_at_peak"]
    assert (tmp_path / "plots" / "memory_step.png").stat().st_size > 0
    line = next(line for line in out.splitlines() if line.startswith("memory of step 2 on rank 0: peak "))
    assert "largest holder" in line and "plan: peak" in line


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["zero3", "ddp"])
def test_two_ranks_record_their_step_with_the_peak_results_json_reports(tmp_path, preset):
    results, record, _ = recorded(tmp_path, f"parallel={preset}", "trainer.devices=2")
    check_record(results, record)
    assert (resized_from_start(record) > 0) == (preset == "zero3")
    other = json.loads((tmp_path / "logs" / "memory_step_rank1.json").read_text())
    assert other["rank"] == 1 and other["peak_bytes"] > other["start_bytes"]


class TwoLayers(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def lightning_fit(tmp_path, callback: StepMemoryCallback, max_steps: int) -> None:
    """A plain Lightning fit of ``TwoLayers`` accumulating two micro-batches a step."""
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 16, generator=generator), torch.randn(64, 1, generator=generator))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
                         accumulate_grad_batches=2, default_root_dir=tmp_path)
    trainer.fit(TwoLayers(), DataLoader(data, batch_size=4))


def test_a_step_of_micro_batches_is_recorded_with_its_phases_and_modules(tmp_path):
    callback = StepMemoryCallback(step=1, largest=3)
    lightning_fit(tmp_path, callback, max_steps=3)
    record = json.loads((tmp_path / "logs" / "memory_step.json").read_text())
    assert record["peak_bytes"] == callback.result["peak_bytes"] and record["step"] == 1
    assert [span["phase"] for span in record["phases"]] == ["forward", "backward", "forward", "backward", "optimiser"]
    made = {(holder["module"], holder["phase"]) for holder in record["holders"]}
    assert {("Sequential.0", "forward"), ("Sequential.2", "backward")} <= made, made  # the outermost by its class
    start = {holder["made_by"] for holder in record["holders"] if holder["phase"] == "start"}
    assert {"parameter", "optimiser state", "batch"} <= start  # Adam's moments exist from the first step on
    assert len(record["largest_at_peak"]) == 3 and record["planned_moments_bytes"] is None
    assert callback.line.startswith("memory of step 2 on rank 0: peak ")


def test_a_fit_that_never_reaches_the_step_records_nothing_and_says_so(tmp_path, capsys):
    callback = StepMemoryCallback(step=5)
    lightning_fit(tmp_path, callback, max_steps=2)
    assert callback.result is None and not (tmp_path / "logs").exists()
    assert "memory: step 6 is not among this fit's steps (1 to 2): nothing recorded" in capsys.readouterr().out


def test_the_counter_tells_every_change_even_from_another_thread():
    changes: list[int] = []
    with LiveStorages(listener=lambda key, delta, tensor: changes.append(delta)) as live:
        a = torch.ones(1000)
        b = a * 2
        worker = threading.Thread(target=lambda box: box.clear(), args=([b],))
        del b
        worker.start()  # the thread drops b's last reference: b's storage is released there
        worker.join()
        gc.collect()
        c = a + 1
    assert sum(changes) == live.live == 2 * 4000 and len(changes) == 4
    running = [sum(changes[:i + 1]) for i in range(len(changes))]
    assert max(running) == live.peak == 2 * 4000
    del c


def test_a_timeline_finds_its_peak_and_the_holders_alive_then():
    timeline = StepTimeline(0, 0, "test", holders=[Holder(100, [], "", "", "start", "parameter"),
                                                   Holder(300, [3], "float32", "m.a", "forward", "aten.mm"),
                                                   Holder(50, [1], "float32", "m.b", "backward", "aten.mul")],
                            start={0: 100},
                            events=[MemoryEvent(0.1, 300, 1, "forward"), MemoryEvent(0.2, 50, 2, "backward"),
                                    MemoryEvent(0.3, -300, 1, "backward"), MemoryEvent(0.4, 200, 2, "optimiser")])
    assert timeline.live() == [100, 400, 450, 150, 350]
    assert timeline.peak() == (450, 2)
    assert [(holder.module, size) for holder, size in timeline.largest_at_peak(2)] == [("m.a", 300), ("", 100)]
    assert timeline.phase_spans() == [("forward", 0, 1), ("backward", 1, 3), ("optimiser", 3, 4)]


def test_a_cuda_trace_counts_blocks_from_allocation_to_completed_free():
    timeline = StepTimeline(0, 0, "test", holders=[Holder(1000, [], "", "", "start", "held before the step")],
                            start={0: 1000})
    frames = [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
              {"filename": "/run/model.py", "line": 7, "name": "forward"}]
    trace = [{"action": "segment_alloc", "addr": 0, "size": 4096, "time_us": 10},
             {"action": "alloc", "addr": 8, "size": 512, "time_us": 11, "frames": frames},
             {"action": "free_requested", "addr": 8, "size": 512, "time_us": 12},
             {"action": "free_completed", "addr": 8, "size": 512, "time_us": 13},
             {"action": "free_completed", "addr": 99, "size": 200, "time_us": 14}]
    add_trace(timeline, trace, 10, {"after_forward": 12})
    assert timeline.live() == [1000, 1512, 1000, 800]
    assert timeline.holders[1].module == "/run/model.py:7 forward" and timeline.events[2].holder == 0
    assert timeline.moments == {"after_forward": 1}


@pytest.mark.parametrize("options,key", [({"step": -1}, "callbacks.memory.step"),
                                         ({"step": 3}, "callbacks.memory.step"),
                                         ({"largest": 0}, "callbacks.memory.largest"),
                                         ({"steps": 1}, "callbacks.memory.steps")])
def test_options_outside_their_range_are_refused_by_name(options, key):
    node = {"_target_": "disttrain.observe.memory_callback.StepMemoryCallback", **options}
    with pytest.raises(ConfigError) as refused:
        check_memory_callbacks({"memory": node}, max_steps=3)
    assert refused.value.key == key


def test_validation_checks_the_memory_options_before_ranks_start(make_config):
    with pytest.raises(ConfigError, match=r"callbacks.memory.step=5 is invalid: a step the run takes: below "
                                          r"trainer.max_steps=3"):
        validate(make_config([*RUN, "callbacks.memory.step=5"]))
