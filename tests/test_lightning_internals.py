"""Lightning's private names that disttrain relies on live in ``disttrain/lightning_internals.py`` alone, and exist
in the installed Lightning with the meaning relied on: a release that renames one fails here, not silently in a
run (pyproject.toml also caps Lightning below its next minor release)."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import lightning
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

import disttrain

PACKAGE = Path(disttrain.__file__).parent
ADAPTER = PACKAGE / "lightning_internals.py"


def test_the_epoch_loops_private_names_are_there():
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    loop = trainer.fit_loop.epoch_loop
    assert isinstance(loop, _TrainingEpochLoop)
    # skip_sigterm_broadcast, validation_follows, forget_step_values, count_stepped_batches
    for name in ("_broadcast_sigterm_tensor", "_batches_that_stepped", "_results", "_should_check_val_fx"):
        assert hasattr(loop, name), name
    assert hasattr(trainer.fit_loop, "_data_fetcher")
    assert "_batches_that_stepped" in loop.state_dict()["state_dict"]  # restored from a checkpoint's loop state


def test_model_checkpoints_private_methods_are_there():
    # ModelCheckpointSteps overrides and calls these
    for name in ("_save_topk_checkpoint", "_save_last_checkpoint", "_save_checkpoint", "_monitor_candidates",
                 "_should_save_on_train_epoch_end"):
        assert callable(getattr(ModelCheckpoint, name, None)), name
    assert list(inspect.signature(ModelCheckpoint._save_last_checkpoint).parameters) == [
        "self", "trainer", "monitor_candidates"]
    checkpoint = ModelCheckpoint(every_n_train_steps=3)
    for name in ("_every_n_train_steps", "_last_checkpoint_saved", "_last_global_step_saved"):
        assert hasattr(checkpoint, name), name
    assert checkpoint._every_n_train_steps == 3


def test_a_logged_results_step_cache_is_the_name_forget_step_values_clears():
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric

    source = inspect.getsource(_ResultMetric)
    assert "self._forward_cache: Optional[Any] = None" in source  # set per step, read for the logger's row


def test_the_strategy_and_module_private_names_are_there():
    from lightning.pytorch.strategies import ModelParallelStrategy

    assert callable(ModelParallelStrategy._setup_distributed)
    assert "self._device_mesh" in inspect.getsource(ModelParallelStrategy.device_mesh.fget)
    assert "self._device_mesh" in inspect.getsource(pl.LightningModule.device_mesh.fget)
    from lightning.pytorch.loggers import WandbLogger

    assert "self._wandb_init" in inspect.getsource(WandbLogger.__init__)


def _defined_private(text: str) -> set[str]:
    """Private names a source text defines: functions, attributes set on self, module globals and classes."""
    names = set(re.findall(r"\bdef (_[a-zA-Z]\w*)", text))
    names |= set(re.findall(r"self\.(_[a-zA-Z]\w*)\s*[:=]", text))
    names |= set(re.findall(r"^(_[a-zA-Z]\w*)\s*[:=]", text, re.M))
    names |= set(re.findall(r"^class (_[A-Za-z]\w*)", text, re.M))
    return {name for name in names if not name.startswith("__")}


def _lightning_private() -> set[str]:
    """Every private name defined anywhere in Lightning, less those torch's Module and Optimizer and Python's
    threads define too (a subclass of those uses them by right)."""
    names: set[str] = set()
    for path in Path(lightning.__file__).parent.rglob("*.py"):
        names |= _defined_private(path.read_text(errors="ignore"))
    for module in ("torch.nn.modules.module", "torch.optim.optimizer", "threading"):
        names -= _defined_private(inspect.getsource(importlib.import_module(module)))
    return names


def _imports(tree: ast.Module) -> dict[str, str]:
    """Local name -> dotted path, for what a module imports from Lightning."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning"):
            names.update({alias.asname or alias.name: f"{node.module}.{alias.name}" for alias in node.names})
        elif isinstance(node, ast.Import):
            names.update({alias.asname: alias.name for alias in node.names
                          if alias.name.startswith("lightning") and alias.asname})
    return names


def _resolve(dotted: str) -> object | None:
    """The object a dotted Lightning path names (None where it is not one)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            value = getattr(value, part, None)
        return value
    return None


def private_uses(sources: dict[str, str]) -> list[str]:
    """``path:line name`` for each place in ``sources`` (path -> text) that imports, reads, sets or overrides a
    private name of Lightning: a private import from a Lightning module; in a class built on a Lightning class, a
    method or ``self`` attribute with a private name that class's Lightning bases define; elsewhere, a private
    attribute (or a name given to getattr/hasattr/setattr) that Lightning defines and disttrain itself does not."""
    everywhere = _lightning_private()
    trees = {path: ast.parse(text) for path, text in sources.items()}
    bases: dict[str, set[type]] = {}  # disttrain class name -> the Lightning classes it is built on
    for _ in range(4):  # classes built on disttrain classes built on Lightning's, a few levels deep
        for tree in trees.values():
            imported = _imports(tree)
            for node in ast.walk(tree):
                if not isinstance(node, ast.ClassDef):
                    continue
                found = set()
                for base in map(ast.unparse, node.bases):
                    head, _, rest = base.partition(".")
                    if head in imported:
                        value = _resolve(imported[head] + (f".{rest}" if rest else ""))
                        if isinstance(value, type):
                            found.add(value)
                    found |= bases.get(base.rsplit(".", 1)[-1], set())
                if found:
                    bases[node.name] = found
    # private names disttrain defines for itself: a module's own functions, classes and globals, and attributes it
    # sets by name (``object.__setattr__(self, "_model", ...)``); its methods and the attributes it sets on self are
    # read on self, so a name that is also one of theirs gives no licence to read it on another object
    own: set[str] = set()
    for tree in trees.values():
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                own.add(node.name)
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                own.update(target.id for target in targets if isinstance(target, ast.Name))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and "setattr" in ast.unparse(node.func) and len(node.args) > 1
                    and isinstance(node.args[1], ast.Constant)):
                own.add(node.args[1].value)
    uses = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning"):
                uses += [f"{path}:{node.lineno} {a.name}" for a in node.names if a.name.startswith("_")]
            elif isinstance(node, ast.ClassDef) and node.name in bases:
                theirs = set()
                for cls in bases[node.name]:
                    for parent in cls.__mro__:
                        if parent.__module__.startswith("lightning"):
                            theirs |= _defined_private(inspect.getsource(parent))
                for sub in ast.walk(node):
                    name = sub.name if isinstance(sub, ast.FunctionDef) else (
                        sub.attr if isinstance(sub, ast.Attribute) and ast.unparse(sub.value) == "self" else None)
                    if name in theirs:
                        uses.append(f"{path}:{sub.lineno} {name}")
            elif isinstance(node, ast.Attribute) and ast.unparse(node.value) != "self":
                if node.attr in everywhere and node.attr not in own:
                    uses.append(f"{path}:{node.lineno} {node.attr}")
            elif (isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "hasattr", "setattr")
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
                name = node.args[1].value
                if name in everywhere and name not in own:
                    uses.append(f"{path}:{node.lineno} {name}")
    return sorted(set(uses))


def test_no_module_but_the_adapter_touches_a_private_lightning_name():
    sources = {str(path.relative_to(PACKAGE.parent)): path.read_text() for path in sorted(PACKAGE.rglob("*.py"))
               if path != ADAPTER}
    assert private_uses(sources) == []


def test_the_scan_finds_each_way_of_touching_a_private_name():
    adapter = ADAPTER.read_text()
    assert private_uses({"adapter.py": adapter})  # the adapter itself is full of them
    cases = {
        "a.py": "from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE\n",
        "b.py": "def f(trainer):\n    return trainer._checkpoint_connector\n",
        "c.py": ("from lightning.pytorch.callbacks import ModelCheckpoint\n\n\nclass C(ModelCheckpoint):\n"
                 "    def _save_checkpoint(self, trainer, filepath):\n        pass\n"),
        "d.py": ("import lightning.pytorch as pl\n\n\nclass D(pl.Callback):\n    def __init__(self):\n"
                 "        self._start = 0\n"),  # a name of its own, not one Callback defines
        "e.py": "import sys\n\n\ndef f():\n    return getattr(sys.modules['lightning'], '_console')\n",
        # a name disttrain also gives an attribute of its own, read on Lightning's optimizer wrapper
        "f.py": ("class Outer:\n    def __init__(self):\n        self._optimizer = None\n\n\n"
                 "def f(optimizer):\n    return getattr(optimizer, '_optimizer', optimizer)\n"),
    }
    assert [use.split(":")[0] for use in private_uses(cases)] == ["a.py", "b.py", "c.py", "e.py", "f.py"]
