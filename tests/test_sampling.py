"""What every data module shares: per-rank sampling that one process reproduces, whole optimiser steps an
epoch, and evaluation that counts each sample once on any number of ranks."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from disttrain.data import DigitsConfig, PyDocsConfig, SyntheticTokensConfig, TokensConfig, build_datamodule
from disttrain.data.base import IGNORE_INDEX, BatchReader
from tests.conftest import attach
from tests.test_data import write_tokens


def samples(batch) -> list[bytes]:
    return [x.numpy().tobytes() for x in batch[0]]


def shard_sampler(loader) -> DistributedSampler:
    """The DistributedSampler under a training loader's sampler wrappers (steps; batches, where batched)."""
    sampler = loader.sampler
    while not isinstance(sampler, DistributedSampler):
        sampler = sampler.sampler
    return sampler


def drops_incomplete_batches(loader) -> bool:
    return getattr(loader, "drop_last", False) or getattr(loader.sampler, "drop_last", False)


@pytest.mark.parametrize("cfg", [DigitsConfig(), DigitsConfig(augment=True), PyDocsConfig(block_size=8),
                                 SyntheticTokensConfig(num_samples=64, vocab_size=50, block_size=4)],
                         ids=["digits", "digits-augment", "pydocs", "synthetic_tokens"])
@pytest.mark.parametrize("epoch", [0, 3])
def test_two_ranks_see_the_samples_of_one_process(cfg, epoch):
    """A single process with batch 2B and two ranks with batch B train on the same samples each step."""
    batch, steps = 4, 4
    single = build_datamodule(cfg, micro_batch_size=2 * batch, seed=7).train_dataloader()
    ranks = [attach(build_datamodule(cfg, micro_batch_size=batch, seed=7), 2, rank).train_dataloader()
             for rank in range(2)]
    for loader in (single, *ranks):
        assert drops_incomplete_batches(loader)
        loader.sampler.set_epoch(epoch)
    assert shard_sampler(ranks[0]).num_replicas == 2 and shard_sampler(ranks[1]).rank == 1
    assert shard_sampler(single).num_replicas == 1 and shard_sampler(single).epoch == epoch
    iterators = [iter(loader) for loader in (single, *ranks)]
    seen = []
    for _ in range(steps):
        whole, first, second = (next(it) for it in iterators)
        assert len(samples(first)) == len(samples(second)) == batch
        assert Counter(samples(whole)) == Counter(samples(first) + samples(second))
        seen.append(samples(whole))
    assert seen[0] != seen[1]


def test_sampler_epoch_changes_the_order_and_evaluation_is_unshuffled():
    datamodule = build_datamodule(PyDocsConfig(block_size=8), micro_batch_size=4, seed=0)
    loader = datamodule.train_dataloader()
    first = samples(next(iter(loader)))
    assert samples(next(iter(loader))) == first
    loader.sampler.set_epoch(1)
    assert samples(next(iter(loader))) != first
    val = attach(datamodule, 2, 1).val_dataloader()
    assert not val.sampler.shuffle and not val.drop_last and not val.sampler.drop_last
    assert list(val.sampler)[:3] == [1, 3, 5]
    assert val.persistent_workers is False and val.num_workers == 0


def test_no_trainer_or_no_distributed_kwargs_means_one_replica():
    datamodule = build_datamodule(DigitsConfig(), micro_batch_size=4, seed=0)
    assert datamodule.replicas() == (1, 0)
    datamodule.trainer = SimpleNamespace(distributed_sampler_kwargs=None)
    assert datamodule.replicas() == (1, 0)
    sampler = shard_sampler(datamodule.train_dataloader())
    settings = (sampler.num_replicas, sampler.rank, sampler.shuffle, sampler.seed, sampler.drop_last)
    assert settings == (1, 0, True, 0, True)


def test_workers_load_the_same_batches(tmp_path):
    write_tokens(tmp_path)
    cfg = TokensConfig(path=str(tmp_path), block_size=16, samples_per_epoch=16)
    in_process = list(build_datamodule(cfg, micro_batch_size=4, seed=0).train_dataloader())
    cfg.num_workers = 2
    loader = build_datamodule(cfg, micro_batch_size=4, seed=0).train_dataloader()
    assert loader.persistent_workers
    with_workers = list(loader)
    assert len(in_process) == len(with_workers) == 4
    for a, b in zip(in_process, with_workers, strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("cfg", [DigitsConfig(), DigitsConfig(augment=True), PyDocsConfig(block_size=8),
                                 SyntheticTokensConfig(num_samples=64, vocab_size=50, block_size=4)],
                         ids=["digits", "digits-augment", "pydocs", "synthetic_tokens"])
def test_batched_reads_give_the_batches_of_sample_reads(cfg):
    """Datasets read a micro-batch per call give the tensors a per-sample loader collates, in its order."""
    datamodule = attach(build_datamodule(cfg, micro_batch_size=6, seed=3), 2, 1)
    loader = datamodule.train_dataloader()
    assert isinstance(loader, BatchReader)  # the sampler yields whole batches to the dataset's get_batch
    loader.sampler.set_epoch(2)
    per_sample = DataLoader(datamodule.datasets["train"], batch_size=6, sampler=loader.sampler.sampler,
                            drop_last=True)
    batched, reference = list(loader), list(per_sample)
    assert len(batched) == len(reference) == len(loader) > 1
    for (x, y), (x_ref, y_ref) in zip(batched, reference, strict=True):
        assert x.dtype == x_ref.dtype and y.dtype == y_ref.dtype
        assert torch.equal(x, x_ref) and torch.equal(y, y_ref)


@pytest.mark.parametrize("accumulation", [1, 2, 4])
def test_an_epoch_holds_only_whole_optimiser_steps(accumulation):
    """Digits' 1258 training images at a global batch of 64: 19 steps whatever the accumulation."""
    micro = 64 // (2 * accumulation)
    ranks = []
    for rank in range(2):
        datamodule = attach(build_datamodule(DigitsConfig(), micro_batch_size=micro, seed=0), 2, rank)
        datamodule.accumulation = accumulation
        ranks.append(datamodule.train_dataloader())
    assert [len(loader) for loader in ranks] == [19 * accumulation] * 2
    seen = Counter(s for loader in ranks for batch in loader for s in samples(batch))
    assert sum(seen.values()) == 19 * 64 and max(seen.values()) == 1


@pytest.mark.parametrize("full_batches", [False, True])
def test_evaluation_on_ranks_counts_every_sample_once(full_batches):
    """Digits' 359 test images on 2 ranks: every image once with its label, padding only with ignored labels."""
    reference = build_datamodule(DigitsConfig(), micro_batch_size=32, seed=0).datasets["test"]
    labels = Counter((x.numpy().tobytes(), int(y)) for x, y in (reference[i] for i in range(len(reference))))
    seen, padding, batch_sizes = Counter(), 0, []
    for rank in range(2):
        datamodule = attach(build_datamodule(DigitsConfig(), micro_batch_size=32, seed=0), 2, rank)
        datamodule.full_eval_batches = full_batches
        for inputs, targets in datamodule.test_dataloader():
            batch_sizes.append(len(targets))
            for x, y in zip(inputs, targets, strict=True):
                if int(y) == IGNORE_INDEX:
                    padding += 1
                else:
                    seen[(x.numpy().tobytes(), int(y))] += 1
    assert seen == labels
    assert padding == (2 * 32 * 6 - 359 if full_batches else 1)
    assert not full_batches or set(batch_sizes) == {32}


@pytest.mark.parametrize("seed", [0, 3, 2**63 + 5, 2**64 - 1, -7])
def test_a_batch_of_draws_has_the_bits_of_one_draw_at_a_time(seed):
    import random

    import numpy as np

    from disttrain.counter_random import counter_random, counter_random_array

    rng = random.Random(seed)
    epochs = [rng.randrange(0, 10**6) for _ in range(200)] + [0, 2**40]
    indices = [rng.randrange(0, 2**40) for _ in range(200)] + [0, 1]
    drawn = counter_random_array(seed, np.array(epochs), np.array(indices))
    assert drawn.dtype == np.uint64
    assert [int(x) for x in drawn] == [counter_random(seed, e, i) for e, i in zip(epochs, indices, strict=True)]
