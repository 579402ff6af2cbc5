"""A disttrain data module as Lightning's Trainer takes one.

``disttrain.data.base.DataModule`` has Lightning's data module hooks but not its base class (the job process
builds data modules to validate a config, and importing Lightning there cost seconds before a config error
printed). The Trainer wants a ``LightningDataModule``: ``LightningData`` is one that hands every hook to the
disttrain module and shares its trainer with it.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from disttrain.data.base import DataModule


class LightningData(pl.LightningDataModule):
    """Lightning's view of ``data``: setup, the three loaders and the saved training position are ``data``'s own,
    and the trainer Lightning attaches is ``data``'s too (its loaders shard by the trainer's ranks). Any other
    attribute is read from ``data``, so a callback reads ``trainer.datamodule.spec`` or ``.datasets`` as before."""

    def __init__(self, data: DataModule) -> None:
        self.data = data
        """The disttrain data module."""
        super().__init__()

    def __getattr__(self, name: str) -> Any:
        if name == "data":  # not set yet: no module to read from
            raise AttributeError(name)
        return getattr(self.data, name)

    @property
    def trainer(self) -> Any:
        """The attached trainer, which is ``data``'s."""
        return self.data.trainer

    @trainer.setter
    def trainer(self, trainer: Any) -> None:
        self.data.trainer = trainer

    def setup(self, stage: str | None = None) -> None:
        """Build ``data``'s splits."""
        self.data.setup(stage)

    def train_dataloader(self) -> Any:
        """``data``'s training loader."""
        return self.data.train_dataloader()

    def val_dataloader(self) -> DataLoader:
        """``data``'s validation loader."""
        return self.data.val_dataloader()

    def test_dataloader(self) -> DataLoader:
        """``data``'s test loader."""
        return self.data.test_dataloader()

    def teardown(self, stage: str) -> None:
        """``data``'s own teardown, where it has one (a mixture logs what its last batches read)."""
        hook = getattr(self.data, "teardown", None)
        if hook is not None:
            hook(stage)

    def state_dict(self) -> dict[str, Any]:
        """``data``'s training position."""
        return self.data.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume ``data`` at a saved position."""
        self.data.load_state_dict(state_dict)


_VIEWS: dict[type, type[LightningData]] = {}


def lightning_data(data: Any) -> pl.LightningDataModule:
    """``data`` as the Trainer takes it: a disttrain data module in a ``LightningData`` whose class bears the
    module's class name (Lightning files the data's state in a checkpoint under that name, as checkpoints written
    before this view existed do); a Lightning data module (the federated rounds') as it is."""
    if not isinstance(data, DataModule):
        return data
    own = type(data)
    if own not in _VIEWS:
        _VIEWS[own] = type(own.__name__, (LightningData,), {"__qualname__": own.__qualname__, "__doc__": own.__doc__})
    return _VIEWS[own](data)


def data_module_of(trainer: pl.Trainer) -> DataModule | None:
    """The disttrain data module feeding ``trainer``, or None (none attached, or a Lightning data module of
    another kind)."""
    view = trainer.datamodule
    return view.data if isinstance(view, LightningData) else None
