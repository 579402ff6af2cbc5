"""Data registry: configs name a data set (``data.name``) and ``build_datamodule`` builds its data module.

Each data module registers itself with its config schema, a dataclass whose ``validate()`` rejects bad
values (and missing files) before any rank starts. A data module reports the shape of its data as
``spec`` (a ``DataSpec``) right after construction, without loading anything large, and owns its
sampling: every loader shards over the data-parallel ranks with a seeded ``DistributedSampler``.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from disttrain.data.base import DataModule, EpochDistributedSampler, counter_random
from disttrain.registry import Registry

DATA: Registry[DataModule] = Registry("data")

# The data modules register themselves in DATA, so they are imported after it exists.
from disttrain.data.digits import DigitsConfig, DigitsDataModule  # noqa: E402
from disttrain.data.folder import ImageFolderConfig, ImageFolderDataModule  # noqa: E402
from disttrain.data.spec import DataSpec  # noqa: E402
from disttrain.data.synthetic import (  # noqa: E402
    SyntheticImagesConfig,
    SyntheticImagesDataModule,
    SyntheticTokensConfig,
    SyntheticTokensDataModule,
)
from disttrain.data.text import PyDocsConfig, PyDocsDataModule, TokensConfig, TokensDataModule  # noqa: E402
from disttrain.data.user import UserDataConfig, build_user_datamodule  # noqa: E402
from disttrain.data.windows import MemmapTokens, TokenWindows  # noqa: E402


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


__all__ = [
    "DATA",
    "DataModule",
    "DataSpec",
    "DigitsConfig",
    "DigitsDataModule",
    "EpochDistributedSampler",
    "ImageFolderConfig",
    "ImageFolderDataModule",
    "MemmapTokens",
    "PyDocsConfig",
    "PyDocsDataModule",
    "SyntheticImagesConfig",
    "SyntheticImagesDataModule",
    "SyntheticTokensConfig",
    "SyntheticTokensDataModule",
    "TokenWindows",
    "TokensConfig",
    "TokensDataModule",
    "UserDataConfig",
    "build_datamodule",
    "build_user_datamodule",
    "counter_random",
]
