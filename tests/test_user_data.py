"""Users' own data: a callable named by ``data._target_`` (the factories below)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import Dataset, IterableDataset

from disttrain.data.base import IGNORE_INDEX
from disttrain.data.spec import DataSpec
from disttrain.data.user import build_user_datamodule
from disttrain.errors import ConfigError
from tests.conftest import attach

HERE = "tests.test_user_data"


# ---------------------------------------------------------------- factories named by data._target_


class Indexed(Dataset):
    """Image ``i`` is filled with the value ``i`` (so a batch tells which samples it holds), label ``i % 3``."""

    def __init__(self, size: int, offset: int = 0, channels: int = 2, side: int = 4, numpy: bool = False) -> None:
        self.size, self.offset, self.channels, self.side, self.numpy = size, offset, channels, side, numpy

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        if not 0 <= index < self.size:
            raise IndexError(index)
        value = self.offset + index
        image = np.full((self.channels, self.side, self.side), value, dtype=np.float64)
        if self.numpy:
            return image, value % 3  # numpy float64 image and a Python int label
        return torch.from_numpy(image).float(), torch.tensor(value % 3)


def images(train: int = 42, val: int = 11, test: int | None = 7, numpy: bool = False, **extra):
    """Image splits of ``Indexed``; ``test=None`` leaves the test split out."""
    splits = {"train": Indexed(train, 0, numpy=numpy), "val": Indexed(val, 1000, numpy=numpy)}
    if test is not None:
        splits["test"] = Indexed(test, 2000, numpy=numpy)
    return {**splits, **extra}


def tokens(count: int = 20, block: int = 8, high: int = 50, vocab_size: int | None = None):
    """Next-token windows of random ids below ``high``."""
    rng = np.random.default_rng(0)

    def windows(n: int) -> list:
        ids = rng.integers(0, high, (n, block + 1))
        return [(torch.from_numpy(row[:-1]), torch.from_numpy(row[1:])) for row in ids]

    ids = windows(count)
    ids[3] = (ids[3][0].clone(), ids[3][1].clone())
    ids[3][0][0] = high + 6  # the largest id anywhere in train, in an input
    out = {"train": ids, "val": windows(4)}
    return out if vocab_size is None else {**out, "vocab_size": vocab_size}


def failing(message: str = "no such bucket"):
    raise RuntimeError(message)


def returns_list():
    return [Indexed(4), Indexed(4)]


def without_val():
    return {"train": Indexed(4)}


def unknown_key():
    return {"train": Indexed(4), "valid": Indexed(4)}


class Stream(IterableDataset):
    def __iter__(self):
        return iter([(torch.zeros(2, 4, 4), torch.tensor(0))])


def iterable():
    return {"train": Stream(), "val": Indexed(4)}


def not_dataset():
    return {"train": Indexed(4), "val": object()}


def empty():
    return {"train": Indexed(4), "val": Indexed(0)}


def not_pair():
    return {"train": [{"x": torch.zeros(2, 4, 4), "y": 0}], "val": Indexed(4)}


def strings():
    return {"train": [("an image", 0)], "val": Indexed(4)}


def flat_images():
    return {"train": [(torch.zeros(16), torch.tensor(0))], "val": Indexed(4)}


def not_square():
    return {"train": [(torch.zeros(3, 4, 5), torch.tensor(0))], "val": Indexed(4)}


def negative_label():
    return {"train": [(torch.zeros(2, 4, 4), 0), (torch.zeros(2, 4, 4), -1)], "val": Indexed(4)}


def unreadable():
    class Broken(Indexed):
        def __getitem__(self, index):
            raise KeyError("missing.png")

    return {"train": Broken(4), "val": Indexed(4)}


def mismatched():
    return {"train": Indexed(4), "val": Indexed(4, side=6)}


def wrong_size_key():
    return images(vocab_size=10)


def bad_num_classes():
    return images(num_classes="ten")


def small_num_classes():
    return images(num_classes=1)  # the first validation image (value 1000) has label 1


# ---------------------------------------------------------------- the callable's data


def build(target: str, micro_batch_size: int = 4, seed: int = 0, **kwargs):
    return build_user_datamodule({"_target_": f"{HERE}.{target}", **kwargs}, micro_batch_size, seed)


def indices(batch) -> list[int]:
    return [int(v) for v in batch[0][:, 0, 0, 0]]


def test_image_spec_is_inferred_and_samples_are_tensors():
    datamodule = build("images")
    assert datamodule.spec == DataSpec(kind="image", num_classes=3, in_channels=2, image_size=4)
    assert datamodule.notice is None
    image, label = datamodule.datasets["train"][5]
    assert image.dtype == torch.float32 and label.dtype == torch.int64 and int(label) == 2


def test_numpy_samples_are_converted_and_node_may_be_a_dictconfig():
    node = OmegaConf.create({"_target_": f"{HERE}.images", "numpy": True, "num_classes": 5, "num_workers": 0})
    datamodule = build_user_datamodule(node, micro_batch_size=4, seed=0)
    assert datamodule.spec.num_classes == 5
    image, label = datamodule.datasets["val"][0]
    assert image.dtype == torch.float32 and image.shape == (2, 4, 4) and label.dtype == torch.int64
    batch = next(iter(datamodule.val_dataloader()))
    assert batch[0].dtype == torch.float32 and batch[1].dtype == torch.int64


def test_missing_test_split_is_the_validation_split_with_a_notice():
    datamodule = build("images", test=None, num_workers=1)
    assert datamodule.datasets["test"] is datamodule.datasets["val"]
    assert "test" in datamodule.notice and "validation" in datamodule.notice
    assert datamodule.num_workers == 1


def test_two_ranks_cover_the_training_epoch_once_and_validation_exactly():
    train, val, batch = 42, 11, 4
    seen: list[int] = []
    evaluated: list[int] = []
    for rank in range(2):
        datamodule = attach(build("images", micro_batch_size=batch, train=train, val=val), 2, rank)
        loader = datamodule.train_dataloader()
        loader.sampler.set_epoch(0)
        seen += [i for b in loader for i in indices(b)]
        for inputs, targets in datamodule.val_dataloader():
            real = targets != IGNORE_INDEX  # padding that evens out the ranks' shares counts nowhere
            evaluated += [int(v) - 1000 for v in inputs[real, 0, 0, 0]]
    assert len(seen) == len(set(seen)) == (train // 2) // batch * batch * 2  # the partial step is dropped
    assert set(seen) <= set(range(train))
    assert sorted(evaluated) == list(range(val))


def test_mid_epoch_resume_continues_after_the_batches_seen():
    def epoch(datamodule, number: int) -> list[list[int]]:
        loader = datamodule.train_dataloader()
        loader.sampler.set_epoch(number)
        return [indices(b) for b in loader]

    for rank in range(2):
        full = epoch(attach(build("images", micro_batch_size=3), 2, rank), 1)
        resumed = attach(build("images", micro_batch_size=3), 2, rank)
        resumed.load_state_dict({"epoch": 1, "batches": 2})
        assert epoch(resumed, 1) == full[2:]
        assert epoch(resumed, 2) != full  # other epochs run whole, in their own order
        assert len(epoch(resumed, 2)) == len(full)


def test_text_is_inferred_as_text():
    datamodule = build("tokens")
    assert datamodule.spec == DataSpec(kind="text", vocab_size=57, block_size=8, masked_targets=True)
    inputs, targets = next(iter(datamodule.train_dataloader()))
    assert inputs.shape == targets.shape == (4, 8) and inputs.dtype == targets.dtype == torch.int64
    assert build("tokens", vocab_size=100).spec.vocab_size == 100


@pytest.mark.parametrize(("target", "kwargs", "fragment"), [
    ("nowhere_at_all.make", {}, "there is no module 'nowhere_at_all'"),
    (f"{HERE}.no_such_factory", {}, "no_such_factory"),
    (f"{HERE}.HERE", {}, "a callable, not a str"),
    (f"{HERE}.failing", {}, "RuntimeError: no such bucket"),
    (f"{HERE}.tokens", {"colour": "red"}, "TypeError"),
    (f"{HERE}.returns_list", {}, "returned a list"),
    (f"{HERE}.without_val", {}, "'val' missing"),
    (f"{HERE}.unknown_key", {}, "unknown keys ['valid']"),
    (f"{HERE}.iterable", {}, "map-style"),
    (f"{HERE}.not_dataset", {}, "'val' is a builtins.object"),
    (f"{HERE}.empty", {}, "'val' has no samples"),
    (f"{HERE}.not_pair", {}, "not an (input, target) pair"),
    (f"{HERE}.strings", {}, "builtins.str"),
    (f"{HERE}.flat_images", {}, "float32 [16]"),
    (f"{HERE}.not_square", {}, "square"),
    (f"{HERE}.negative_label", {}, "label is -1"),
    (f"{HERE}.unreadable", {}, "KeyError"),
    (f"{HERE}.mismatched", {}, "one kind and shape"),
    (f"{HERE}.wrong_size_key", {}, "'num_classes' (not 'vocab_size')"),
    (f"{HERE}.bad_num_classes", {}, "positive int"),
    (f"{HERE}.small_num_classes", {}, "num_classes is 1"),
])
def test_unusable_data_is_one_config_error_naming_the_target(target, kwargs, fragment):
    with pytest.raises(ConfigError) as caught:
        build_user_datamodule({"_target_": target, **kwargs}, micro_batch_size=4, seed=0)
    message = str(caught.value)
    assert message.startswith(f"data._target_={target!r} is invalid: "), message
    assert fragment in message, message
    assert "\n" not in message


def test_a_node_without_a_target_or_with_bad_workers_is_refused():
    with pytest.raises(ConfigError, match=r"data\._target_"):
        build_user_datamodule({"root": "x"}, micro_batch_size=4, seed=0)
    with pytest.raises(ConfigError, match=r"data\.num_workers"):
        build("images", num_workers=-1)


def test_user_data_trains_under_ddp_and_resumes_mid_epoch_exactly(tmp_path, capsys):
    from disttrain.launch.job import train
    from tests.conftest import compose_config
    from tests.test_run import step_losses

    # 1400 training images at a global batch of 64: 21 steps an epoch; a checkpoint kept at step 6
    base = ["data=custom", "data._target_=tests.user_models.digit_splits", "parallel=ddp", "trainer.devices=2",
            "trainer.max_steps=12", "trainer.val_check_interval=6", "trainer.check_val_every_n_epoch=null",
            "checkpoint.save_top_k=-1", "trainer.log_every_n_steps=1", "logger=csv", "callbacks=none",
            "trainer.run_test=false"]
    train(compose_config(base, tmp_path / "straight"))
    assert 'returned no "test" split: testing uses the validation split' in capsys.readouterr().out
    step6 = tmp_path / "straight" / "checkpoints" / "step6.ckpt"
    train(compose_config([*base, f"resume={step6}"], tmp_path / "resumed"))
    straight, resumed = step_losses(tmp_path / "straight"), step_losses(tmp_path / "resumed")
    assert len(straight) == 12 and resumed == straight[6:]
