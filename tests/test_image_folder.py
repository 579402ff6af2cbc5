"""Images on disk: ``data=image_folder``, one folder of images per class (or given train/val/test folders)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from disttrain.data import DATA, ImageFolderConfig, ImageFolderDataModule, build_datamodule
from disttrain.data.spec import DataSpec
from disttrain.errors import ConfigError


def write_image(path: Path, mode: str, seed: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(seed)
    shape = (10, 12) if mode == "L" else (10, 12, 3)  # 12 wide, 10 high: not square
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(path)  # 2-D: L, 3 channels: RGB


CLASSES = ("cat", "ant", "bee")  # written in this order; labels follow the sorted names


def write_classes(root: Path, per_class: int = 6, classes=CLASSES) -> Path:
    for c, name in enumerate(classes):
        for i in range(per_class):
            suffix = ".PNG" if i == 0 else (".bmp" if i == 1 else ".png")
            write_image(root / name / f"img{i}{suffix}", "L" if i % 2 else "RGB", seed=c * 100 + i)
    (root / "README.txt").write_text("not an image")
    (root / classes[0] / "labels.csv").write_text("not an image either")
    return root


def folder(path: Path, **fields) -> ImageFolderDataModule:
    return build_datamodule({"name": "image_folder", "path": str(path), **fields}, micro_batch_size=2, seed=0)


def test_image_folder_is_registered():
    assert "image_folder" in DATA.names()
    assert DATA.get("image_folder").schema is ImageFolderConfig


def test_image_folder_spec_splits_and_sorted_labels(tmp_path, monkeypatch):
    import PIL.Image

    root = write_classes(tmp_path / "pets")
    opened = []
    original = PIL.Image.open
    monkeypatch.setattr(PIL.Image, "open", lambda *a, **k: opened.append(a) or original(*a, **k))
    datamodule = folder(root, image_size=8)
    assert not opened  # construction lists the files; it reads none
    assert datamodule.spec == DataSpec(kind="image", num_classes=3, in_channels=3, image_size=8)
    assert datamodule.classes == ("ant", "bee", "cat")
    files = datamodule.layout.files
    assert {split: len(f) for split, f in files.items()} == {"train": 12, "val": 3, "test": 3}
    assert datamodule.num_train_samples == 12
    every = [path for f in files.values() for path, _ in f]
    assert len(every) == len(set(every)) == 18
    for split in files.values():
        for path, label in split:
            assert label == datamodule.classes.index(Path(path).parent.name)
        assert sorted(label for _, label in split) == [label for _, label in split]
    image, label = datamodule.datasets["val"][0]
    assert image.shape == (3, 8, 8) and image.dtype == torch.float32 and label.dtype == torch.int64
    assert [int(label) for _, label in datamodule.datasets["val"]] == [0, 1, 2]
    # the same split seed gives the same split; another seed another
    assert folder(root).layout.files == files
    assert folder(root, split_seed=1).layout.files != files


def test_image_folder_normalises_by_the_training_split(tmp_path):
    # measured: |mean| within 2.3e-7 and std within 1e-7 of 1 (fp32 rounding); stats from another split would
    # be off by ~1e-2
    root = write_classes(tmp_path / "pets")
    for channels in (3, 1):
        datamodule = folder(root, image_size=8, channels=channels)
        train = torch.stack([image for image, _ in datamodule.datasets["train"]])
        assert train.shape == (12, channels, 8, 8)
        assert torch.allclose(train.mean(dim=(0, 2, 3)), torch.zeros(channels), atol=1e-6)
        assert torch.allclose(train.std(dim=(0, 2, 3), unbiased=False), torch.ones(channels), atol=1e-6)
        inputs, targets = next(iter(datamodule.train_dataloader()))
        assert inputs.shape == (2, channels, 8, 8) and targets.dtype == torch.int64


def test_image_folder_given_splits_are_used_as_given(tmp_path):
    root = tmp_path / "given"
    write_classes(root / "train", per_class=3, classes=("b", "a"))
    write_classes(root / "val", per_class=2, classes=("a", "b"))
    datamodule = folder(root, image_size=6)
    assert "has no test/ folder: testing uses the validation split" in datamodule.notice
    files = datamodule.layout.files
    assert {split: len(f) for split, f in files.items()} == {"train": 6, "val": 4, "test": 4}
    assert all(Path(path).parts[-3] == "val" for path, _ in files["val"])
    assert datamodule.datasets["test"] is datamodule.datasets["val"]
    write_classes(root / "test", per_class=1, classes=("a",))
    with_test = folder(root)
    assert with_test.notice is None and len(with_test.layout.files["test"]) == 1


@pytest.mark.parametrize(("case", "key", "fragment"), [
    ("missing path", "data.path", "no such directory"),
    ("no class folders", "data.path", "no class folders"),
    ("empty class", "data.path", "empty_class"),
    ("one class", "data.path", "at least 2 classes"),
    ("lone train", "data.path", "no val/"),
    ("val_fraction=0", "data.val_fraction", "strictly between"),
    ("test_fraction=1.0", "data.test_fraction", "strictly between"),
    ("sum", "data.test_fraction", "below 1"),
    ("no training image", "data.val_fraction", "training image"),
    ("no validation image", "data.val_fraction", "rounds to 0"),
    ("channels=2", "data.channels", "1 (grayscale) or 3 (RGB)"),
    ("image_size=0", "data.image_size", "at least 1 pixel"),
])
def test_image_folder_refusals(tmp_path, case, key, fragment):
    root = tmp_path / "data"
    fields: dict = {}
    if case == "missing path":
        root = tmp_path / "nowhere"
    elif case == "no class folders":
        root.mkdir()
        (root / "README.txt").write_text("x")
    elif case == "empty class":
        write_classes(root)
        (root / "empty_class").mkdir()
        (root / "empty_class" / "notes.txt").write_text("x")
    elif case == "one class":
        write_classes(root, classes=("only",))
    elif case == "lone train":
        write_classes(root / "train")
    else:
        write_classes(root, per_class=2)
        fields = {"sum": {"val_fraction": 0.6, "test_fraction": 0.4},
                  "no training image": {"val_fraction": 0.5, "test_fraction": 0.3},
                  "no validation image": {"val_fraction": 0.2}}.get(case, {})
        if "=" in case:
            name, value = case.split("=")
            fields = {name: float(value) if "fraction" in name else int(value)}
    with pytest.raises(ConfigError) as caught:
        folder(root, **fields)
    message = str(caught.value)
    assert message.startswith(f"{key}="), message
    assert fragment in message, message
    assert "\n" not in message
