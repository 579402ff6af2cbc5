"""Your own images, one folder per class: classification of whatever ``data.path`` holds, read lazily."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from omegaconf import MISSING
from torch.utils.data import Dataset

from disttrain import checks
from disttrain.data.base import DataModule
from disttrain.data.registry import DATA
from disttrain.data.spec import DataSpec
from disttrain.errors import ConfigError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
"""File endings read as images (in any case); other files are ignored."""
STATS_SAMPLE = 1000
"""At most this many training images, evenly spread over the (class-ordered) training split, give the
normalisation statistics."""
LAYOUT = "a directory with one folder of images per class (or train/ and val/ folders, each with one per class)"


@dataclass
class ImageFolderConfig:
    """Images in one folder per class under ``path``; the sorted class folder names give the labels 0, 1, ...

    When ``path`` holds ``train/`` and ``val/`` (and optionally ``test/``) folders, each with one folder per
    class, those splits are used as given (the fractions are then ignored; without ``test/``, testing uses
    the validation split). Otherwise each class is split at random (seeded by ``split_seed``) into
    ``val_fraction`` validation, ``test_fraction`` test and the rest training images, rounded per class.

    Images (.png, .jpg, .jpeg, .bmp, .gif, .webp, searched in sub-folders too) are read one at a time when a
    loader asks for them, converted to ``channels`` channels, resized to ``image_size`` x ``image_size``
    (non-square images are stretched), scaled to [0, 1], then normalised per channel by the mean and
    standard deviation of the training split, computed once from up to 1000 training images spread evenly
    over the split (all of them when there are fewer).
    """

    name: str = "image_folder"
    """Registry name."""
    path: str = MISSING
    """Directory holding one folder of images per class (or train/, val/ [, test/] folders of such)."""
    image_size: int = 32
    """Side length, in pixels, of the square every image is resized to."""
    channels: int = 3
    """1 (images converted to grayscale) or 3 (converted to RGB)."""
    val_fraction: float = 0.1
    """Fraction of each class held out for validation (ignored when the folder gives train/ and val/)."""
    test_fraction: float = 0.1
    """Fraction of each class held out for the final test (ignored when the folder gives train/ and val/)."""
    split_seed: int = 0
    """Seed of the train/val/test split (independent of the run's seed, so runs compare on one split)."""
    num_workers: int = 0
    """DataLoader worker processes per rank (they decode the images)."""

    def validate(self) -> None:
        """Sizes and fractions in range (the folder itself is checked when the data module lists it, once)."""
        if not self.image_size >= 1:
            raise ConfigError("data.image_size", self.image_size, "a side length of at least 1 pixel")
        if self.channels not in (1, 3):
            raise ConfigError("data.channels", self.channels, "1 (grayscale) or 3 (RGB)")
        checks.held_out_fractions(self.val_fraction, self.test_fraction, below=1.0)
        checks.non_negative("data.num_workers", self.num_workers)


@dataclass(frozen=True)
class FolderLayout:
    """What an image folder holds: its classes and, per split, the image files with their labels."""

    classes: tuple[str, ...]
    """Class folder names, sorted: the label of a class is its position here."""
    files: dict[str, list[tuple[str, int]]]
    """``{"train"|"val"|"test": [(path, label), ...]}`` in class order, then path order."""
    notice: str | None = None
    """A line about a default taken (no test/ folder), else None."""


def list_images(folder: str) -> list[str]:
    """Image files under ``folder`` (sub-folders too, hidden entries skipped), sorted by path."""
    found = []
    for directory, subdirectories, names in os.walk(folder, followlinks=True):
        subdirectories[:] = [d for d in subdirectories if not d.startswith(".")]
        found += [os.path.join(directory, name) for name in names
                  if not name.startswith(".") and name.lower().endswith(IMAGE_SUFFIXES)]
    return sorted(found)


def class_folders(folder: str) -> list[str]:
    """Names of the (non-hidden) folders in ``folder``, sorted."""
    return sorted(entry.name for entry in os.scandir(folder) if entry.is_dir() and not entry.name.startswith("."))


def _class_files(folder: str, classes: list[str], label_of: dict[str, int], path: str) -> list[tuple[str, int]]:
    """``(path, label)`` of every image of every class folder in ``folder``; a ConfigError for one empty."""
    files = []
    for name in classes:
        images = list_images(os.path.join(folder, name))
        if not images:
            raise ConfigError("data.path", path, f"{LAYOUT}; the class folder {os.path.join(folder, name)} holds "
                              f"no images ({', '.join(IMAGE_SUFFIXES)})")
        files += [(image, label_of[name]) for image in images]
    return files


def _classes(folder: str, path: str) -> list[str]:
    classes = class_folders(folder)
    if not classes:
        raise ConfigError("data.path", path, f"{LAYOUT}; {folder} has no class folders")
    if len(classes) < 2:
        raise ConfigError("data.path", path, f"{LAYOUT} of at least 2 classes; {folder} has only {classes[0]!r}")
    return classes


def scan_folder(cfg: ImageFolderConfig) -> FolderLayout:
    """List the classes and split the image files (no image is read); ConfigError for an unusable folder."""
    if cfg.path == MISSING or not isinstance(cfg.path, str) or not cfg.path:
        raise ConfigError("data.path", None, f"{LAYOUT}; it is not set")
    root = os.path.expanduser(cfg.path)
    if not os.path.isdir(root):
        raise ConfigError("data.path", cfg.path, f"{LAYOUT}; there is no such directory")
    given = [split for split in ("train", "val") if os.path.isdir(os.path.join(root, split))]
    if len(given) == 1:
        # A lone train/ or val/ is far more likely a half-given layout than a class of that name.
        missing = {"train", "val"}.difference(given).pop()
        raise ConfigError("data.path", cfg.path, f"{LAYOUT}; it has {given[0]}/ but no {missing}/")
    if given:
        return _given_splits(cfg, root)
    classes = _classes(root, cfg.path)
    by_class = [_class_files(root, [name], {name: label}, cfg.path) for label, name in enumerate(classes)]
    return FolderLayout(tuple(classes), _stratified(cfg, classes, by_class))


def _given_splits(cfg: ImageFolderConfig, root: str) -> FolderLayout:
    """The train/, val/ and optional test/ folders as they are; their class folders must be train/'s."""
    classes = _classes(os.path.join(root, "train"), cfg.path)
    label_of = {name: label for label, name in enumerate(classes)}
    files, notice = {}, None
    for split in ("train", "val", "test"):
        folder = os.path.join(root, split)
        if split == "test" and not os.path.isdir(folder):
            files["test"] = files["val"]
            notice = f"data.path={cfg.path} has no test/ folder: testing uses the validation split (val/)"
            continue
        present = class_folders(folder)
        if not present:
            raise ConfigError("data.path", cfg.path, f"{LAYOUT}; {folder} has no class folders")
        unknown = [name for name in present if name not in label_of]
        if unknown:
            raise ConfigError("data.path", cfg.path, f"{LAYOUT}; {folder} has class folders that train/ lacks: "
                              f"{unknown}")
        files[split] = _class_files(folder, present, label_of, cfg.path)
    return FolderLayout(tuple(classes), files, notice)


def _stratified(cfg: ImageFolderConfig, classes: list[str],
                by_class: list[list[tuple[str, int]]]) -> dict[str, list[tuple[str, int]]]:
    """Each class split at random into its rounded validation and test shares and the training rest."""
    rng = np.random.default_rng(cfg.split_seed)
    files: dict[str, list[tuple[str, int]]] = {"train": [], "val": [], "test": []}
    for name, images in zip(classes, by_class, strict=True):
        count = len(images)
        # round half up: Python's round() sends 0.5 to 0, which would leave small classes out of val and test
        val, test = (math.floor(fraction * count + 0.5) for fraction in (cfg.val_fraction, cfg.test_fraction))
        if count - val - test < 1:
            raise ConfigError("data.val_fraction", cfg.val_fraction,
                              f"fractions that leave every class a training image; with test_fraction "
                              f"{cfg.test_fraction}, class {name!r} ({count} images) keeps none")
        order = rng.permutation(count)
        parts = {"val": order[:val], "test": order[val:val + test], "train": order[val + test:]}
        for split, chosen in parts.items():
            files[split] += [images[i] for i in sorted(chosen)]
    for split in ("val", "test"):
        if not files[split]:
            raise ConfigError(f"data.{split}_fraction", getattr(cfg, f"{split}_fraction"),
                              f"a fraction that puts at least one image into {split}; it rounds to 0 in every "
                              "class")
    return files


def load_image(path: str, image_size: int, channels: int) -> torch.Tensor:
    """One image file as float32 ``[channels, image_size, image_size]`` in [0, 1]."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            if image.mode == "P" and "transparency" in image.info:
                image = image.convert("RGBA")  # palette transparency converts straight to RGB only with a warning
            image = image.convert("L" if channels == 1 else "RGB")
            image = image.resize((image_size, image_size), Image.Resampling.BILINEAR)
            pixels = np.asarray(image, dtype=np.float32) / 255.0
    except (OSError, ValueError) as err:
        # the DataLoader worker's traceback then names the file to fix or remove
        raise OSError(f"cannot read image {path}: {err}") from err
    pixels = pixels[None] if channels == 1 else pixels.transpose(2, 0, 1)
    return torch.from_numpy(np.ascontiguousarray(pixels))


def channel_stats(files: list[tuple[str, int]], image_size: int, channels: int,
                  limit: int = STATS_SAMPLE) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and standard deviation (each ``[channels, 1, 1]``) of the [0, 1] pixels of up to
    ``limit`` images of ``files``, evenly spread over it (a stratified sample, as ``files`` is class-ordered)."""
    chosen = np.unique(np.linspace(0, len(files) - 1, min(len(files), limit)).round().astype(np.int64))
    total = np.zeros(channels)
    squares = np.zeros(channels)
    for index in chosen:
        pixels = load_image(files[index][0], image_size, channels).double().flatten(1)
        total += pixels.sum(1).numpy()
        squares += (pixels * pixels).sum(1).numpy()
    count = len(chosen) * image_size * image_size
    mean = total / count
    std = np.sqrt(np.maximum(squares / count - mean * mean, 0.0))
    std[std < 1e-6] = 1.0  # a constant channel: centre it, don't divide by zero
    shape = (channels, 1, 1)
    return torch.tensor(mean, dtype=torch.float32).view(shape), torch.tensor(std, dtype=torch.float32).view(shape)


class FolderImages(Dataset):
    """Image files with labels, each read when asked for and normalised by ``mean`` and ``std``."""

    def __init__(self, files: list[tuple[str, int]], image_size: int, channels: int, mean: torch.Tensor,
                 std: torch.Tensor) -> None:
        self.files, self.image_size, self.channels, self.mean, self.std = files, image_size, channels, mean, std

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        path, label = self.files[index]
        pixels = load_image(path, self.image_size, self.channels)
        return (pixels - self.mean) / self.std, torch.tensor(label, dtype=torch.int64)


@DATA.register("image_folder", ImageFolderConfig)
class ImageFolderDataModule(DataModule):
    """Classification of the images of a folder with one sub-folder per class (see ``ImageFolderConfig``).

    Construction lists the files only; the normalisation statistics are computed when the splits are first
    built, and each image is read when a loader asks for it.
    """

    def __init__(self, cfg: ImageFolderConfig, micro_batch_size: int, seed: int) -> None:
        super().__init__(micro_batch_size, seed, cfg.num_workers)
        self.cfg = cfg
        self.layout = scan_folder(cfg)  # a ConfigError for an unusable folder, before any rank starts
        self.notice = self.layout.notice
        """A line for the runner to print about a default taken (no test/ folder), else None."""
        self.classes: tuple[str, ...] = self.layout.classes
        """Class names (the folder names), in label order."""
        self._spec = DataSpec(kind="image", num_classes=len(self.classes), in_channels=cfg.channels,
                              image_size=cfg.image_size)

    @property
    def spec(self) -> DataSpec:
        """Images, one class per folder, the configured channels and size."""
        return self._spec

    @property
    def num_train_samples(self) -> int:
        """Training images per epoch, over all ranks (counted from the listing; nothing is read)."""
        return len(self.layout.files["train"])

    def _datasets(self) -> dict[str, Dataset]:
        c = self.cfg
        mean, std = channel_stats(self.layout.files["train"], c.image_size, c.channels)
        splits: dict[str, Any] = {}
        for split, files in self.layout.files.items():
            # a test split that is the validation split stays one dataset object
            same = next((d for s, d in splits.items() if self.layout.files[s] is files), None)
            splits[split] = same if same is not None else FolderImages(files, c.image_size, c.channels, mean, std)
        return splits
