"""The progress displays show the training loss without a host read on steps that log nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from disttrain.rank.progress import LOSS_KEY, RichLossBar, TqdmLossBar


@pytest.mark.parametrize("bar_class", [TqdmLossBar, RichLossBar])
def test_the_bar_reads_each_logged_loss_once_and_lightning_none(monkeypatch, bar_class):
    reads = []
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: reads.append(self) or item(self))
    bar = bar_class()
    first, second = torch.tensor(2.5), torch.tensor(1.25)
    trainer = SimpleNamespace(loggers=[], progress_bar_metrics={}, callback_metrics={LOSS_KEY: first})
    shown = [bar.get_metrics(trainer, None)[LOSS_KEY] for _ in range(3)]  # one logged value, three batches
    trainer.callback_metrics[LOSS_KEY] = second
    shown += [bar.get_metrics(trainer, None)[LOSS_KEY] for _ in range(2)]
    assert shown == ["2.5", "2.5", "2.5", "1.25", "1.25"]
    assert [value is first for value in reads] == [True, False]  # one read per logged value


def test_the_task_logs_its_loss_off_lightnings_progress_bar():
    from disttrain.data.spec import DataSpec
    from disttrain.optim import AdamWConfig, SchedulerConfig
    from disttrain.rank.task import TrainTask

    task = TrainTask(torch.nn.Linear(4, 2), DataSpec("image", num_classes=2, in_channels=1, image_size=2),
                     AdamWConfig(), SchedulerConfig(), total_steps=3)
    logged = {}
    task.log = lambda name, value, **options: logged.__setitem__(name, options)
    task._log_position = lambda *_args, **_kwargs: None
    task.logs_this_step = lambda: True
    optimizer = torch.optim.SGD(task.parameters(), lr=0.1)
    task._log_step_row(torch.tensor(1.0), optimizer)
    assert not logged[LOSS_KEY].get("prog_bar", False)  # Lightning would read it back after every batch


@pytest.mark.parametrize(("tokens_per_sample", "shown"), [(1, "| 40.0 samples/s"), (256, "| 10,240 tokens/s")])
def test_the_plain_line_gives_a_text_models_rate_in_tokens(capsys, tokens_per_sample, shown):
    from disttrain.rank.callbacks import ThroughputMeter
    from disttrain.rank.progress import PlainProgress

    meter = ThroughputMeter(global_batch=8, tokens_per_sample=tokens_per_sample)
    meter.steps, meter.seconds = 10, 2.0
    trainer = SimpleNamespace(is_global_zero=True, global_step=5, max_steps=10, current_epoch=0, optimizers=[],
                              callback_metrics={LOSS_KEY: torch.tensor(2.5)})
    PlainProgress(5, meter).on_train_batch_end(trainer)
    assert capsys.readouterr().out == f"step 5/10 | epoch 0 | loss 2.5000 {shown}\n"
