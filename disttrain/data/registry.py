"""Data registry: configs name a data set (``data.name``) and ``build_datamodule`` builds its data module.

Each data module registers itself with its config schema, a dataclass whose ``validate()`` rejects bad
values (and missing files) before any rank starts. The registry lives apart from the package so that the
data modules can register in it while the package imports them.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from disttrain.data.base import DataModule
from disttrain.data.user import UserDataConfig, build_user_datamodule
from disttrain.registry import Registry

DATA: Registry[DataModule] = Registry("data")
"""Built-in data sets by name: each data module adds its own when it is imported."""


def build_datamodule(cfg: Any, micro_batch_size: int, seed: int) -> DataModule:
    """Validate ``cfg`` and build the data module it names, with per-rank batch ``micro_batch_size``.

    ``cfg`` is the typed schema object (as ``disttrain.config.validate`` produces), or a dict/DictConfig
    with a ``name``, which is merged into the registered schema first.
    """
    if isinstance(cfg, UserDataConfig):
        return build_user_datamodule(cfg.node, micro_batch_size, seed)
    if isinstance(cfg, (dict, DictConfig)):
        schema = DATA.get(cfg.get("name")).schema
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), cfg))
    cfg.validate()
    return DATA.build(cfg, micro_batch_size=micro_batch_size, seed=seed)
