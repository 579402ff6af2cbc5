"""Every kind of run that steps by hand takes one step protocol (norm and clip, non-finite checks, log, step or
skip, zero, schedule), and a kind hands the strategy what it needs when the strategy is built, never later."""

from __future__ import annotations

import ast
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from disttrain.data.spec import DataSpec
from disttrain.fault.steps import StepAgreement
from disttrain.optim import AdamWConfig, SchedulerConfig
from disttrain.rank.kinds.pipelined import PipelineTask
from disttrain.rank.kinds.torchft import ReplicaTask

ROOT = Path(__file__).resolve().parent.parent
SPEC = DataSpec("image", num_classes=2, in_channels=1, image_size=2)


class RecordingOptimizer:
    """An SGD behind Lightning's optimiser interface that records its steps and zeroings."""

    def __init__(self, params: list[torch.nn.Parameter], events: list[str]) -> None:
        self.optimizer = torch.optim.SGD(params, lr=0.1)
        self.param_groups = self.optimizer.param_groups
        self.events = events

    def step(self) -> None:
        self.events.append("step")
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.events.append("zero")
        self.optimizer.zero_grad(set_to_none=set_to_none)


def _instrumented(task, events: list[str]):
    """``task`` attached to a stand-in Trainer, every piece of the step protocol recorded in ``events``."""
    net = task.net
    net(torch.ones(1, 4)).sum().backward()
    task._trainer = SimpleNamespace(global_step=0, current_epoch=0, log_every_n_steps=1, max_steps=10,
                                    world_size=1, testing=False)
    optimizer = RecordingOptimizer(list(net.parameters()), events)
    task.optimizers = lambda: optimizer
    task.lr_schedulers = lambda: SimpleNamespace(step=lambda: events.append("schedule"))
    task.log = lambda name, value, **_: events.append(f"log {name}")
    task._log_position = lambda *_args, **_kwargs: None
    for name, label in (("_gradient_norm", lambda *_: "norm"), ("_check_finite", lambda what, _value: what),
                        ("_count_applied_step", lambda applied, *_: f"count {applied}")):
        original = getattr(task, name)
        setattr(task, name, lambda *args, _o=original, _l=label: events.append(_l(*args)) or _o(*args))
    return task


def _pipelined_step(loss: float) -> list[str]:
    events: list[str] = []
    slot = SimpleNamespace(run=lambda *_, **__: (torch.tensor(loss), None), pipeline=SimpleNamespace(pp_group=None))
    task = _instrumented(PipelineTask(torch.nn.Linear(4, 2), SPEC, AdamWConfig(), SchedulerConfig(), total_steps=10,
                                      agreement=StepAgreement("skip"), pipeline=slot, accumulation=1, clip=1.0,
                                      loss_ranks=1), events)
    task.training_step((torch.ones(1, 4), torch.zeros(1)), 0)
    return events


def _replica_step(loss: float, commits: bool) -> list[str]:
    events: list[str] = []
    steps = SimpleNamespace(average=lambda tensors: None,
                            commit=lambda finite: events.append(f"commit {finite}") or (finite and commits))
    task = _instrumented(ReplicaTask(torch.nn.Linear(4, 2), SPEC, AdamWConfig(), SchedulerConfig(), total_steps=10,
                                     agreement=StepAgreement("skip"), gradients_agree=True, steps=steps,
                                     accumulation=1, clip=1.0), events)
    task._record_train_loss(torch.tensor(loss))
    task._finish_step()
    return events


TAKEN = ["log train/grad_norm", "log train/loss", "log train/lr"]
"""What a step that is taken (applied or skipped) logs, before its optimiser step."""


def test_a_finite_step_takes_the_same_sequence_in_every_kind_that_steps_by_hand():
    applied = ["norm", "the training loss", "the gradient norm", *TAKEN, "step", "schedule", "count True", "zero"]
    assert _pipelined_step(2.0) == applied
    replica = _replica_step(2.0, commits=True)
    assert replica.pop(3) == "commit True"  # the groups vote once this group's step is checked
    assert replica == applied


def test_a_non_finite_step_is_skipped_but_counted_and_a_refused_one_is_not_taken():
    # the loss's check fails first: the norm is not checked; the skipped step steps without gradients
    assert _pipelined_step(math.nan) == ["norm", "the training loss", *TAKEN, "zero", "step", "schedule",
                                         "count False", "zero"]
    refused = ["norm", "the training loss", "the gradient norm", "commit True", "count False", "zero"]
    assert _replica_step(2.0, commits=False) == refused  # tried again under the same number: no row, no step
    assert _replica_step(math.nan, commits=True) == ["norm", "the training loss", "commit False", "count False",
                                                     "zero"]


def _sets_a_strategy_attribute(node: ast.AST) -> bool:
    """``strategy.x = ...``, ``trainer.strategy.x += ...`` or ``setattr(strategy, ...)``."""
    def names_strategy(target: ast.AST) -> bool:
        return (isinstance(target, ast.Name) and target.id == "strategy") or (
            isinstance(target, ast.Attribute) and target.attr == "strategy")

    if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return any(isinstance(t, ast.Attribute) and names_strategy(t.value) for t in targets)
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
            and bool(node.args) and names_strategy(node.args[0]))


def test_no_kind_sets_a_strategy_attribute_after_it_is_built():
    offenders = [f"{path.relative_to(ROOT)}:{node.lineno}"
                 for path in sorted((ROOT / "disttrain" / "rank").rglob("*.py"))
                 for node in ast.walk(ast.parse(path.read_text())) if _sets_a_strategy_attribute(node)]
    assert offenders == [], "hand it to the strategy in RunKind.strategy_hooks instead"


class SealedStrategy(SimpleNamespace):
    """What a kind's callbacks read of the strategy; setting anything on it fails."""

    def __init__(self, **attributes) -> None:
        for name, value in attributes.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value) -> None:
        raise AssertionError(f"a kind set strategy.{name} after the strategy was built")


def test_torchft_hands_the_strategy_its_slot_gate_and_a_peers_state_when_it_is_built(make_config, monkeypatch):
    pytest.importorskip("torchft")
    from disttrain.config import validate
    from disttrain.fault.replica_state import PEER_CHECKPOINT
    from disttrain.parallel.strategy import DistTrainStrategy
    from disttrain.rank.kinds import torchft

    run = validate(make_config(["fault_tolerance.engine=torchft", "parallel=ddp", "trainer.devices=3",
                                "batch.global_size=12", "model=gpt", "model.flavour=micro", "data=pydocs"]))
    kind = torchft.TorchFT(run, StepAgreement())
    strategy = DistTrainStrategy(run.layout, run.train.parallel, hooks=kind.strategy_hooks())
    assert strategy.hooks.replica_slot == (0, 1) and strategy.writes_checkpoints()
    kind.callbacks(SealedStrategy(precision="32-true", root_device=torch.device("cpu"),
                                  comm_counter=strategy.comm_counter, layout=run.layout))
    # the state a live group sends before fit is asked for when the fit loads PEER_CHECKPOINT, once
    monkeypatch.setattr(torchft, "load_peer_state", lambda peer, model, optimizers: {"loaded": peer})
    load = strategy.hooks.in_memory_checkpoint
    kind._receive({"weights": 1})
    assert load("checkpoints/last.ckpt", None, []) is None
    assert load(PEER_CHECKPOINT, None, []) == {"loaded": {"weights": 1}}
    assert load(PEER_CHECKPOINT, None, []) is None
