"""Registered data modules: splits, windows, token files, synthetic shapes and the registry (sampling, which
they share, is in ``test_sampling.py``)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from disttrain.data import (
    DATA,
    DigitsConfig,
    PyDocsConfig,
    SyntheticImagesConfig,
    SyntheticTokensConfig,
    TokensConfig,
    TokenWindows,
    build_datamodule,
)
from disttrain.data.spec import DataSpec
from disttrain.data.text import pydocs_bytes
from disttrain.errors import ConfigError


def write_tokens(directory: Path, train: int = 5000, val: int = 1000, high: int = 300) -> Path:
    rng = np.random.default_rng(0)
    for split, size in (("train", train), ("val", val)):
        rng.integers(0, high, size, dtype=np.uint16).tofile(directory / f"{split}.bin")
    return directory


# ---------------------------------------------------------------- digits


@pytest.fixture(scope="module")
def digits():
    datamodule = build_datamodule(DigitsConfig(), micro_batch_size=16, seed=0)
    datamodule.setup("fit")
    return datamodule


def test_digits_spec_is_known_before_setup():
    datamodule = build_datamodule(DigitsConfig(), micro_batch_size=16, seed=0)
    assert "datasets" not in vars(datamodule)
    assert datamodule.spec == DataSpec(kind="image", num_classes=10, in_channels=1, image_size=8)


def test_digits_split_sizes_types_and_no_overlap(digits):
    sets = digits.datasets
    sizes = {split: len(sets[split]) for split in ("train", "val", "test")}
    assert sizes == {"train": 1258, "val": 180, "test": 359}
    assert sum(sizes.values()) == 1797
    images, labels = sets["train"].images, sets["train"].labels
    assert images.shape == (1258, 1, 8, 8) and images.dtype == torch.float32 and labels.dtype == torch.int64
    keys = {
        split: {(img.numpy().tobytes(), int(lab)) for img, lab in zip(sets[split].images, sets[split].labels,
                                                                       strict=True)}
        for split in sizes
    }
    # Identical images may occur twice in the data set; disjointness is checked on (image, label) pairs.
    assert not keys["train"] & keys["val"] and not keys["train"] & keys["test"]
    assert not keys["val"] & keys["test"]
    # Stratified: every class is in every split in roughly its share.
    for split in sizes:
        counts = torch.bincount(sets[split].labels, minlength=10)
        assert counts.min() >= 0.8 * sizes[split] / 10


def test_digits_normalised_by_train_statistics(digits):
    train = digits.datasets["train"].images
    assert abs(float(train.mean())) < 1e-5 and abs(float(train.std(unbiased=False)) - 1) < 1e-5
    assert abs(float(digits.datasets["val"].images.mean())) < 0.2


def test_digits_split_is_deterministic_and_follows_split_seed(digits):
    again = build_datamodule(DigitsConfig(), micro_batch_size=16, seed=123)
    again.setup()
    for split in ("train", "val", "test"):
        assert torch.equal(again.datasets[split].images, digits.datasets[split].images)
        assert torch.equal(again.datasets[split].labels, digits.datasets[split].labels)
    other = build_datamodule(DigitsConfig(split_seed=1), micro_batch_size=16, seed=0)
    assert not torch.equal(other.datasets["val"].labels, digits.datasets["val"].labels)


def test_digits_augmentation_shifts_per_epoch_deterministically():
    datamodule = build_datamodule(DigitsConfig(augment=True), micro_batch_size=8, seed=0)
    dataset = datamodule.datasets["train"]
    n = len(dataset)
    first = torch.stack([dataset[i][0] for i in range(32)])
    assert torch.equal(first, torch.stack([dataset[i][0] for i in range(32)]))
    next_epoch = torch.stack([dataset[n + i][0] for i in range(32)])
    assert not torch.equal(first, next_epoch)
    assert first.shape == (32, 1, 8, 8)
    # A shift moves pixels and never invents them: the values are those of the image or the blank border.
    blank = float(dataset.images.min())
    for i in range(8):
        image = dataset.images[i]
        assert set(first[i].unique().tolist()) <= set(image.unique().tolist()) | {blank}
    loader = datamodule.train_dataloader()
    loader.sampler.set_epoch(1)
    images, labels = next(iter(loader))
    assert images.shape == (8, 1, 8, 8) and labels.shape == (8,)


def test_digits_config_errors_name_the_key():
    with pytest.raises(ConfigError) as info:
        build_datamodule(DigitsConfig(val_fraction=1.5), micro_batch_size=8, seed=0)
    assert info.value.key == "data.val_fraction"
    with pytest.raises(ConfigError) as info:
        build_datamodule(DigitsConfig(num_workers=-1), micro_batch_size=8, seed=0)
    assert info.value.key == "data.num_workers"
    with pytest.raises(ConfigError) as info:
        build_datamodule(DigitsConfig(), micro_batch_size=0, seed=0)
    assert info.value.key == "batch.micro_size"


# ---------------------------------------------------------------- text windows


def test_pydocs_text_is_byte_tokens():
    data = pydocs_bytes()
    assert data.dtype == np.uint8 and len(data) > 100_000
    datamodule = build_datamodule(PyDocsConfig(block_size=32), micro_batch_size=4, seed=0)
    assert datamodule.spec == DataSpec(kind="text", vocab_size=256, block_size=32)
    train, val = datamodule.datasets["train"], datamodule.datasets["val"]
    assert len(train.data) + len(val.data) == len(data)
    assert len(val.data) == int(len(data) * 0.1)
    assert datamodule.num_train_samples == len(train.data) // 32
    assert datamodule.datasets["test"] is val


def test_windows_shift_by_one_and_are_deterministic():
    datamodule = build_datamodule(PyDocsConfig(block_size=16), micro_batch_size=4, seed=0)
    train = datamodule.datasets["train"]
    for index in (0, 1, 17, len(train) - 1, len(train) + 5):
        x, y = train[index]
        start = train.offset(index)
        assert x.shape == y.shape == (16,) and x.dtype == torch.int64
        assert torch.equal(x[1:], y[:-1])
        assert torch.equal(x, torch.from_numpy(train.data[start:start + 16].astype(np.int64)))
        assert int(y[-1]) == int(train.data[start + 16])
    again = build_datamodule(PyDocsConfig(block_size=16), micro_batch_size=4, seed=0).datasets["train"]
    assert [train.offset(i) for i in range(100)] == [again.offset(i) for i in range(100)]
    other_seed = build_datamodule(PyDocsConfig(block_size=16), micro_batch_size=4, seed=1).datasets["train"]
    assert [train.offset(i) for i in range(100)] != [other_seed.offset(i) for i in range(100)]
    # Each epoch draws fresh offsets.
    assert [train.offset(i) for i in range(100)] != [train.offset(len(train) + i) for i in range(100)]


def test_random_windows_cover_the_whole_range():
    data = np.arange(101, dtype=np.int64)
    windows = TokenWindows(data, block_size=10, num_windows=2000, seed=0)
    offsets = {windows.offset(i) for i in range(len(windows))}
    assert offsets == set(range(91))  # 0 .. len - block_size - 1: every window has its target


def test_a_batchs_offsets_are_the_windows_own_in_every_epoch(monkeypatch):
    """A batch reads its offsets from its epoch's, drawn at once: the same as each window's own draw, within an
    epoch, across an epoch boundary, after going back to an earlier epoch and where an epoch is too large to
    draw at once."""
    import disttrain.data.windows as windows_module

    windows = TokenWindows(np.arange(5000, dtype=np.int64), block_size=10, num_windows=300, seed=3)
    batches = [list(range(0, 32)), list(range(300, 332)), list(range(290, 310)), list(range(5, 37)),
               list(range(900, 932))]
    for indices in batches:
        assert windows.offsets(indices).tolist() == [windows.offset(i) for i in indices]
        inputs, targets = windows.get_batch(indices)
        assert torch.equal(inputs, torch.stack([windows[i][0] for i in indices]))
        assert torch.equal(targets, torch.stack([windows[i][1] for i in indices]))
    # a loader worker gets the tokens, not every window's row of the strided view nor the drawn offsets
    assert len(pickle.dumps(windows)) < 2 * windows.data.nbytes
    monkeypatch.setattr(windows_module, "DRAWN_PER_EPOCH", 100)
    unbuffered = TokenWindows(np.arange(5000, dtype=np.int64), block_size=10, num_windows=300, seed=3)
    assert unbuffered.offsets(list(range(300, 332))).tolist() == windows.offsets(list(range(300, 332))).tolist()
    assert unbuffered._drawn is None


def test_validation_windows_are_consecutive_and_capped():
    data = np.arange(100, dtype=np.int64)
    windows = TokenWindows(data, block_size=10)
    assert len(windows) == 9 and not windows.epoch_indexed
    assert [windows.offset(i) for i in range(9)] == [10 * i for i in range(9)]
    assert torch.equal(windows[8][1], torch.arange(81, 91))
    with pytest.raises(IndexError):
        windows[9]
    assert len(TokenWindows(data, block_size=10, num_windows=3)) == 3
    datamodule = build_datamodule(PyDocsConfig(block_size=16, val_windows=5), micro_batch_size=2, seed=0)
    loader = datamodule.val_dataloader()
    batches = list(loader)
    assert len(batches) == 3 and [len(b[0]) for b in batches] == [2, 2, 1]  # last batch is kept
    assert torch.equal(batches[0][0][1], datamodule.datasets["val"][1][0])


def test_pydocs_samples_per_epoch():
    cfg = PyDocsConfig(block_size=8, samples_per_epoch=40)
    datamodule = build_datamodule(cfg, micro_batch_size=8, seed=0)
    assert datamodule.num_train_samples == 40
    assert len(datamodule.train_dataloader()) == 5


# ---------------------------------------------------------------- token files


def test_tokens_datamodule_reads_memmapped_files(tmp_path):
    write_tokens(tmp_path)
    datamodule = build_datamodule(TokensConfig(path=str(tmp_path), block_size=32), micro_batch_size=4, seed=0)
    assert datamodule.spec == DataSpec(kind="text", vocab_size=320, block_size=32)  # max id 299 -> 300 -> 320
    train = datamodule.datasets["train"]
    assert len(train) == 5000 // 32 and len(datamodule.datasets["val"]) == 999 // 32
    expected = np.fromfile(tmp_path / "train.bin", dtype=np.uint16).astype(np.int64)
    x, y = train[3]
    start = train.offset(3)
    assert torch.equal(x, torch.from_numpy(expected[start:start + 32]))
    assert torch.equal(y, torch.from_numpy(expected[start + 1:start + 33]))
    x, y = next(iter(datamodule.train_dataloader()))
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
    cfg = TokensConfig(path=str(tmp_path), vocab_size=50304)
    explicit = build_datamodule(cfg, micro_batch_size=4, seed=0)
    assert explicit.spec.vocab_size == 50304 and explicit.spec.block_size == 64


def test_tokens_dataset_pickles_without_its_memmap(tmp_path):
    import pickle

    write_tokens(tmp_path)
    datamodule = build_datamodule(TokensConfig(path=str(tmp_path), block_size=8), micro_batch_size=4, seed=0)
    train = datamodule.datasets["train"]
    before = train[0]
    copy = pickle.loads(pickle.dumps(train))
    assert copy.data._array is None and len(pickle.dumps(train)) < 2000
    assert all(torch.equal(a, b) for a, b in zip(before, copy[0], strict=True))


def test_tokens_config_errors_name_data_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError) as info:
        build_datamodule(TokensConfig(path=str(missing)), micro_batch_size=4, seed=0)
    assert info.value.key == "data.path" and "train.bin and val.bin" in str(info.value)
    with pytest.raises(ConfigError) as info:
        build_datamodule(TokensConfig(path=str(tmp_path)), micro_batch_size=4, seed=0)
    assert info.value.key == "data.path" and "no train.bin there" in str(info.value)
    write_tokens(tmp_path)
    (tmp_path / "val.bin").unlink()
    with pytest.raises(ConfigError) as info:
        build_datamodule(TokensConfig(path=str(tmp_path)), micro_batch_size=4, seed=0)
    assert info.value.key == "data.path" and "no val.bin there" in str(info.value)
    write_tokens(tmp_path, val=10)
    with pytest.raises(ConfigError) as info:
        build_datamodule(TokensConfig(path=str(tmp_path), block_size=64), micro_batch_size=4, seed=0)
    assert info.value.key == "data.path" and "val.bin holds 10 tokens; each split needs at least" in str(info.value)


def test_tokens_path_is_required():
    with pytest.raises(Exception, match="path"):
        build_datamodule({"name": "tokens"}, micro_batch_size=4, seed=0)


# ---------------------------------------------------------------- synthetic


def test_synthetic_shapes_and_determinism():
    cfg = SyntheticImagesConfig(num_samples=64, val_samples=16, image_size=12, channels=2, num_classes=5)
    images = build_datamodule(cfg, micro_batch_size=8, seed=0)
    assert images.spec == DataSpec(kind="image", num_classes=5, in_channels=2, image_size=12)
    x, y = next(iter(images.train_dataloader()))
    assert x.shape == (8, 2, 12, 12) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert int(y.max()) < 5 and images.num_train_samples == 64 and len(images.val_dataloader()) == 2
    again = build_datamodule(cfg, micro_batch_size=8, seed=0)
    assert torch.equal(next(iter(again.train_dataloader()))[0], x)

    cfg = SyntheticTokensConfig(num_samples=32, val_samples=8, vocab_size=100, block_size=16)
    tokens = build_datamodule(cfg, micro_batch_size=4, seed=0)
    assert tokens.spec == DataSpec(kind="text", vocab_size=100, block_size=16)
    x, y = next(iter(tokens.train_dataloader()))
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64 and int(x.max()) < 100
    assert torch.equal(x[:, 1:], y[:, :-1])


# ---------------------------------------------------------------- registry


def test_registry_names_schemas_and_unknown_name():
    assert DATA.names() == ["chat", "digits", "image_folder", "mixture", "pydocs", "synthetic_images",
                            "synthetic_tokens", "text", "tokens"]
    for name in DATA.names():
        schema = DATA.get(name).schema
        assert schema().name == name if name != "tokens" else schema.name == "tokens"
        assert hasattr(schema, "validate")
    with pytest.raises(ConfigError) as info:
        build_datamodule({"name": "mnist"}, micro_batch_size=4, seed=0)
    assert info.value.key == "data.name" and "pydocs" in str(info.value)


def test_every_schema_field_is_documented():
    import ast
    import inspect

    for name in DATA.names():
        schema = DATA.get(name).schema
        body = ast.parse(inspect.getsource(schema)).body[0].body
        for node, after in zip(body, body[1:], strict=False):
            if isinstance(node, ast.AnnAssign):
                documented = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                assert documented, (name, node.target.id)
        assert isinstance(body[1], ast.AnnAssign) and body[1].target.id == "name"


def test_dict_configs_are_typed_by_the_schema():
    datamodule = build_datamodule({"name": "pydocs", "block_size": 24}, micro_batch_size=2, seed=0)
    assert isinstance(datamodule.cfg, PyDocsConfig) and datamodule.spec.block_size == 24
