"""Data: configs name a data set (``data.name``) and ``build_datamodule`` builds its data module.

Each data module registers itself with its config schema (see ``registry``), a dataclass whose
``validate()`` rejects bad values (and missing files) before any rank starts; importing this package
imports every built-in data module and so registers it. A data module reports the shape of its data as
``spec`` (a ``DataSpec``) right after construction, without loading anything large, and owns its
sampling: every loader shards over the data-parallel ranks with a seeded ``DistributedSampler``.
"""

from __future__ import annotations

from disttrain.counter_random import counter_random
from disttrain.data.base import DataModule, EpochDistributedSampler
from disttrain.data.chat import ChatConfig, ChatDataModule
from disttrain.data.digits import DigitsConfig, DigitsDataModule
from disttrain.data.folder import ImageFolderConfig, ImageFolderDataModule
from disttrain.data.mixture import MixtureDataModule
from disttrain.data.mixture_config import MixtureConfig, MixtureSource
from disttrain.data.registry import DATA, build_datamodule
from disttrain.data.spec import DataSpec
from disttrain.data.synthetic import (
    SyntheticImagesConfig,
    SyntheticImagesDataModule,
    SyntheticTokensConfig,
    SyntheticTokensDataModule,
)
from disttrain.data.text import PyDocsConfig, PyDocsDataModule, TokensConfig, TokensDataModule
from disttrain.data.user import UserDataConfig, build_user_datamodule
from disttrain.data.user_text import TextConfig, TextDataModule
from disttrain.data.windows import MemmapTokens, TokenWindows

__all__ = [
    "DATA",
    "ChatConfig",
    "ChatDataModule",
    "DataModule",
    "DataSpec",
    "DigitsConfig",
    "DigitsDataModule",
    "EpochDistributedSampler",
    "ImageFolderConfig",
    "ImageFolderDataModule",
    "MemmapTokens",
    "MixtureConfig",
    "MixtureDataModule",
    "MixtureSource",
    "PyDocsConfig",
    "PyDocsDataModule",
    "SyntheticImagesConfig",
    "SyntheticImagesDataModule",
    "SyntheticTokensConfig",
    "SyntheticTokensDataModule",
    "TextConfig",
    "TextDataModule",
    "TokenWindows",
    "TokensConfig",
    "TokensDataModule",
    "UserDataConfig",
    "build_datamodule",
    "build_user_datamodule",
    "counter_random",
]
