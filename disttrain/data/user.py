"""Users' own data: any importable callable named by ``data._target_`` that returns the splits.

``python train.py data._target_=mypkg.data.make +data.root=/data/x`` calls ``mypkg.data.make(root="/data/x")``
once and trains on what it returns; see ``build_user_datamodule`` for what the callable must return and how
the data's kind and sizes are inferred from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import Dataset, IterableDataset

from disttrain import checks
from disttrain.data.base import IGNORE_INDEX, DataModule
from disttrain.data.spec import DataSpec
from disttrain.errors import ConfigError
from disttrain.targets import call, describe_error

KEY = "data._target_"
"""The config key every refusal names."""
SPLITS = ("train", "val", "test")
"""Dataset keys of the returned mapping ("test" optional)."""
SIZES = {"image": "num_classes", "text": "vocab_size"}
"""Optional size key of the returned mapping, per kind of data."""
SAMPLES = ("images (float [C, H, W] with H == W, int label) or text (int [T] token ids, int [T] next-token "
           "targets)")
"""What a sample may be, as messages say it."""


class _Unusable(Exception):
    """A sample that cannot be used; the message says why (turned into a ConfigError naming the sample)."""


def _tensor(value: Any, what: str) -> torch.Tensor:
    """``value`` as a tensor: floats as float32 (the models' parameter type), integers as int64."""
    if isinstance(value, bool) or not isinstance(value, (torch.Tensor, np.ndarray, np.generic, Integral, float)):
        raise _Unusable(f"its {what} is a {type(value).__module__}.{type(value).__qualname__}, not a tensor, "
                        "numpy array or int")
    tensor = torch.as_tensor(value)
    if tensor.is_floating_point():
        return tensor.float()
    return tensor.long() if _integral(tensor) else tensor  # booleans and complex numbers: refused by _kind


def as_pair(sample: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A sample as ``(input, target)`` tensors (numpy arrays and ints converted by ``torch.as_tensor``, floats
    made float32, integers int64); ``_Unusable`` if it is not such a pair."""
    if not isinstance(sample, (tuple, list)) or len(sample) != 2:
        kind = f"a {len(sample)}-element {type(sample).__name__}" if isinstance(sample, (tuple, list)) \
            else f"a {type(sample).__module__}.{type(sample).__qualname__}"
        raise _Unusable(f"it is {kind}, not an (input, target) pair")
    return _tensor(sample[0], "input"), _tensor(sample[1], "target")


def _integral(tensor: torch.Tensor) -> bool:
    return not tensor.is_floating_point() and not tensor.is_complex() and tensor.dtype != torch.bool


def _describe(inputs: torch.Tensor, targets: torch.Tensor) -> str:
    def one(t: torch.Tensor) -> str:
        return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"

    return f"({one(inputs)}, {one(targets)})"


def _kind(inputs: torch.Tensor, targets: torch.Tensor) -> str:
    """"image" or "text" by the shapes and types of one sample; ``_Unusable`` if neither."""
    if inputs.dim() == 3 and inputs.is_floating_point() and targets.dim() == 0 and _integral(targets):
        channels, height, width = inputs.shape
        if min(channels, height, width) < 1:
            raise _Unusable(f"it is {_describe(inputs, targets)}: an image with an empty dimension")
        if height != width:
            raise _Unusable(f"it is {_describe(inputs, targets)}: images must be square (H == W)")
        return "image"
    if inputs.dim() == 1 and _integral(inputs) and targets.dim() == 1 and _integral(targets) \
            and len(inputs) == len(targets) and len(inputs) > 0:
        return "text"
    raise _Unusable(f"it is {_describe(inputs, targets)}")


def _largest(kind: str, inputs: torch.Tensor, targets: torch.Tensor) -> int:
    """The largest label (images) or token id (text) of one sample; ``_Unusable`` if one is negative.

    Text targets may be ``IGNORE_INDEX`` (-100) where no prediction is wanted; the loss skips them.
    """
    if kind == "image":
        label = int(targets)
        if label < 0:
            raise _Unusable(f"its label is {label}; labels must be >= 0")
        return label
    if int(inputs.min()) < 0:
        raise _Unusable(f"it holds token id {int(inputs.min())}; token ids must be >= 0")
    kept = targets[targets != IGNORE_INDEX]
    if kept.numel() and int(kept.min()) < 0:
        raise _Unusable(f"its targets hold {int(kept.min())}; targets must be token ids >= 0 or "
                        f"{IGNORE_INDEX} (ignored)")
    return max(int(inputs.max()), int(kept.max()) if kept.numel() else 0)


class UserSamples(Dataset):
    """A user's map-style dataset whose samples come out as ``(input, target)`` tensors (see ``as_pair``).

    A dataset with a true ``epoch_indexed`` attribute keeps it: it is then read at ``e * len + i`` for
    sample ``i`` of epoch ``e`` (see ``EpochDistributedSampler``), for fresh augmentation every epoch.
    """

    def __init__(self, dataset: Any, split: str) -> None:
        self.dataset, self.split = dataset, split
        self.epoch_indexed = bool(getattr(dataset, "epoch_indexed", False))
        self.length = len(dataset)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return as_pair(self.dataset[index])
        except _Unusable as err:
            raise TypeError(f"{KEY}: {self.split!r} sample {index}: {err}") from None


class UserDataModule(DataModule):
    """The data a user's callable returns, sampled like every registered data set (see ``DataModule``).

    ``target`` (a dotted path) is called once, here, with ``kwargs``; the kind and sizes of the data are
    inferred from what it returns (see ``build_user_datamodule``). ``notice`` is a line for the runner to
    print when a default was taken (no test split), else None.
    """

    def __init__(self, target: str, kwargs: Mapping[str, Any], micro_batch_size: int, seed: int,
                 num_workers: int = 0) -> None:
        super().__init__(micro_batch_size, seed, num_workers)
        self.target = target
        self.notice: str | None = None
        """A line for the runner to print about a default taken, or None."""
        returned = self._call(dict(kwargs))
        self._splits = {name: self._split(name, returned[name]) for name in SPLITS if name in returned}
        if "test" not in self._splits:
            self._splits["test"] = self._splits["val"]
            self.notice = f"{KEY}={target} returned no \"test\" split: testing uses the validation split"
        self._spec = self._infer(returned)

    @property
    def spec(self) -> DataSpec:
        """Inferred from the first training sample (and the given or scanned number of classes or tokens)."""
        return self._spec

    def _datasets(self) -> dict[str, Dataset]:
        return dict(self._splits)

    def _refuse(self, allowed: str) -> ConfigError:
        return ConfigError(KEY, self.target, allowed)

    def _call(self, kwargs: dict[str, Any]) -> Mapping[str, Any]:
        """Locate and call the target; the mapping it returns, checked for its keys."""
        returned = call(self.target, kwargs, KEY, "a callable that returns the data splits")
        expected = 'a mapping {"train": dataset, "val": dataset, ...}'
        if not isinstance(returned, Mapping):
            raise self._refuse(f"a callable that returns {expected}; it returned a {type(returned).__name__}")
        allowed = [*SPLITS, *SIZES.values()]
        unknown = [str(key) for key in returned if key not in allowed]
        if unknown:
            raise self._refuse(f"a callable that returns {expected} with keys among {allowed}; it returned "
                               f"unknown keys {unknown}")
        missing = [key for key in ("train", "val") if key not in returned]
        if missing:
            raise self._refuse(f"a callable that returns {expected}; {' and '.join(map(repr, missing))} "
                               f"missing (it returned {[str(key) for key in returned]})")
        return returned

    def _split(self, name: str, dataset: Any) -> UserSamples:
        """One returned split, checked to be a non-empty map-style dataset."""
        if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__len__")
                                                        and hasattr(dataset, "__getitem__")):
            raise self._refuse(f"map-style datasets (with __len__ and __getitem__); {name!r} is a "
                               f"{type(dataset).__module__}.{type(dataset).__qualname__}")
        try:
            length = len(dataset)
        except Exception as err:  # noqa: BLE001  (the user's __len__ failed; say how)
            raise self._refuse(f"map-style datasets; len() of {name!r} raised {describe_error(err)}") from None
        if length < 1:
            raise self._refuse(f"non-empty datasets; {name!r} has no samples")
        return UserSamples(dataset, name)

    def _sample(self, name: str, index: int) -> tuple[str, torch.Tensor, torch.Tensor]:
        """``(kind, input, target)`` of one sample; ConfigError naming it if it cannot be read or used."""
        where = f"{name!r} sample {index}"
        try:
            sample = self._splits[name].dataset[index]
        except Exception as err:  # noqa: BLE001  (the user's __getitem__ failed; say how)
            raise self._refuse(f"datasets whose samples can be read; reading {where} raised "
                               f"{describe_error(err)}") from None
        try:
            inputs, targets = as_pair(sample)
            return _kind(inputs, targets), inputs, targets
        except _Unusable as err:
            raise self._refuse(f"(input, target) samples, {SAMPLES}; {where}: {err}") from None

    def _infer(self, returned: Mapping[str, Any]) -> DataSpec:
        """The spec from the first training sample; each split's first sample must match it."""
        kind, inputs, _ = self._sample("train", 0)
        for other in SIZES.values():
            if other != SIZES[kind] and other in returned:
                raise self._refuse(f"{SIZES[kind]!r} (not {other!r}) for {kind} data")
        shape = inputs.shape
        # Each split's first sample is also checked against the size, given or scanned, so a validation label
        # the model cannot predict is named here rather than failing inside the loss later.
        firsts = {}
        for name in self._splits:
            other_kind, other_inputs, other_targets = self._sample(name, 0)
            if (other_kind, other_inputs.shape) != (kind, shape):
                raise self._refuse(f"splits of one kind and shape; 'train' sample 0 is {kind} "
                                   f"{list(shape)}, {name!r} sample 0 is {other_kind} {list(other_inputs.shape)}")
            firsts[name] = self._check(kind, name, 0, other_inputs, other_targets)
        size_key = SIZES[kind]
        if size_key in returned:
            size = returned[size_key]
            if isinstance(size, bool) or not isinstance(size, Integral) or size < 1:
                raise self._refuse(f"a positive int {size_key!r}; it returned {size!r}")
            size = int(size)
        else:
            size = 1 + self._scan(kind, shape)
        for name, largest in firsts.items():
            if largest >= size:
                source = "given" if size_key in returned else "1 + the largest in 'train'"
                raise self._refuse(f"{size_key} above every {'label' if kind == 'image' else 'token id'}; "
                                   f"{name!r} sample 0 holds {largest} and {size_key} is {size} ({source})")
        if kind == "image":
            return DataSpec(kind="image", num_classes=size, in_channels=int(shape[0]), image_size=int(shape[1]))
        # any text sample may mark targets IGNORE_INDEX, and finding out would read every one
        return DataSpec(kind="text", vocab_size=size, block_size=int(shape[0]), masked_targets=True)

    def _check(self, kind: str, name: str, index: int, inputs: torch.Tensor, targets: torch.Tensor) -> int:
        try:
            return _largest(kind, inputs, targets)
        except _Unusable as err:
            raise self._refuse(f"labels and token ids >= 0; {name!r} sample {index}: {err}") from None

    def _scan(self, kind: str, shape: torch.Size) -> int:
        """The largest label or token id of the training split, reading every sample once (also checking
        that each has the first one's kind and shape)."""
        largest = 0
        for index in range(len(self._splits["train"])):
            sample_kind, inputs, targets = self._sample("train", index)
            if (sample_kind, inputs.shape) != (kind, shape):
                raise self._refuse(f"training samples of one kind and shape; sample 0 is {kind} {list(shape)}, "
                                   f"sample {index} is {sample_kind} {list(inputs.shape)}")
            largest = max(largest, self._check(kind, "train", index, inputs, targets))
        return largest


@dataclass(frozen=True)
class UserDataConfig:
    """A ``data`` node with ``_target_`` (no registry name): the node itself, checked when it is built."""

    node: dict[str, Any]
    """``_target_``, the callable's arguments and optionally ``num_workers``."""

    @property
    def name(self) -> str:
        """How messages name the data: its dotted path."""
        return str(self.node.get("_target_"))

    def validate(self) -> list[str]:
        """Nothing to check before the callable runs (``build_user_datamodule`` checks what it returns)."""
        return []


def build_user_datamodule(node: Mapping[str, Any] | DictConfig, micro_batch_size: int, seed: int) -> UserDataModule:
    """The data module of a user's callable: ``node`` is the ``data`` config, ``_target_`` and its arguments.

    ``node["_target_"]`` is the dotted path of a callable (a function or a class); every other key of
    ``node`` is its keyword argument, except ``num_workers`` (DataLoader worker processes per rank, default
    0), which is the data module's. It is called once, on every rank, and must return a mapping::

        {"train": dataset, "val": dataset,   # required
         "test": dataset,                    # optional; missing: testing uses "val" (and ``notice`` says so)
         "num_classes": int,                 # optional, image data only
         "vocab_size": int}                  # optional, text data only

    Each dataset is map-style (``__len__`` and ``__getitem__``, e.g. a ``torch.utils.data.Dataset`` or a
    list) and non-empty. A sample is an ``(input, target)`` pair of tensors, numpy arrays or ints (converted
    with ``torch.as_tensor``; floats become float32, integers int64), one of two kinds, told apart by the
    first training sample:

    - image classification: input float ``[C, H, W]`` with ``H == W``, target an int label ``>= 0``.
      ``num_classes``: as given, else 1 + the largest training label (read from every training sample once).
    - next-token prediction: input int ``[T]`` token ids, target int ``[T]`` (the ids shifted by one;
      ``-100`` where no prediction is wanted). ``vocab_size``: as given, else 1 + the largest id of the
      training split (read once). The block size is ``T``.

    Every split's first sample must have the training samples' kind and shape. Labels and ids of the
    validation and test splits must lie below the number of classes or tokens: give it when they may not.
    A dataset with ``epoch_indexed = True`` is read at index ``e * len + i`` for sample ``i`` of epoch ``e``
    (fresh augmentation each epoch; see ``EpochDistributedSampler``).

    Anything else is refused by one ``ConfigError`` naming ``data._target_``: a path that cannot be imported
    or is no callable, a call that raises (its exception and message are named), a result that is not such a
    mapping, a split that is not a non-empty map-style dataset, an unusable or negative sample.
    """
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True)  # type: ignore[assignment]
    if not isinstance(node, Mapping):
        raise ConfigError("data", node, "a mapping with _target_ and the callable's arguments")
    target = node.get("_target_")
    if not isinstance(target, str) or not target:
        raise ConfigError(KEY, target, "the dotted path of a callable that returns the data splits")
    num_workers = node.get("num_workers", 0)
    if isinstance(num_workers, bool) or not isinstance(num_workers, int):
        raise ConfigError("data.num_workers", num_workers, "a number of worker processes >= 0")
    checks.non_negative("data.num_workers", num_workers)
    kwargs = {key: value for key, value in node.items() if key not in ("_target_", "num_workers")}
    return UserDataModule(target, kwargs, micro_batch_size, seed, num_workers)
