"""Datasets load through their real readers; rank shards cover every sample once per epoch."""

import pickle

import numpy as np
import pytest
import torch

from workers.data import DataConfig, DatasetError, load_dataset, rank_train_loader


def write_tiny_cifar10(root, *, per_batch=6, seed=0):
    """A CIFAR-10 in its real on-disk format: pickled dicts in cifar-10-batches-py (the official
    files are Python 2 pickles whose keys read back as str under encoding="latin1")."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, size=per_batch)]
        with open(folder / name, "wb") as f:
            pickle.dump({"batch_label": name, "data": data, "labels": labels}, f)
        batches[name] = (data, labels)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, f)
    return batches


def test_cifar10_real_format_loads_with_the_real_reader(tmp_path):
    batches = write_tiny_cifar10(tmp_path)
    config = DataConfig(dataset="cifar10", root=tmp_path, verify_checksums=False)
    splits = load_dataset(config, seed=0)
    assert splits.train_x.shape == (30, 3, 32, 32)
    assert splits.val_x.shape == (6, 3, 32, 32)
    train_raw = np.concatenate([batches[f"data_batch_{i}"][0] for i in range(1, 6)])
    expected = torch.from_numpy(train_raw.reshape(-1, 3, 32, 32)).float() / 255
    mean = expected.mean(dim=(0, 2, 3), keepdim=True)
    std = expected.std(dim=(0, 2, 3), keepdim=True)
    torch.testing.assert_close(splits.train_x, (expected - mean) / std)
    labels = [v for i in range(1, 6) for v in batches[f"data_batch_{i}"][1]]
    assert splits.train_y.tolist() == labels
    assert splits.val_y.tolist() == batches["test_batch"][1]


def test_cifar10_checksums_are_verified_by_default(tmp_path):
    write_tiny_cifar10(tmp_path)
    with pytest.raises(DatasetError, match="verify_checksums"):
        load_dataset(DataConfig(dataset="cifar10", root=tmp_path), seed=0)


def test_cifar10_missing_or_truncated_files_are_named(tmp_path):
    with pytest.raises(DatasetError, match=r"data\.root: .*cifar-10-batches-py does not exist"):
        load_dataset(DataConfig(dataset="cifar10", root=tmp_path), seed=0)
    write_tiny_cifar10(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(DatasetError, match="lacks data_batch_3"):
        load_dataset(DataConfig(dataset="cifar10", root=tmp_path, verify_checksums=False), seed=0)
    write_tiny_cifar10(tmp_path / "again")
    batch = tmp_path / "again" / "cifar-10-batches-py" / "data_batch_2"
    batch.write_bytes(batch.read_bytes()[:100])
    config = DataConfig(dataset="cifar10", root=tmp_path / "again", verify_checksums=False)
    with pytest.raises(DatasetError, match="could not read the CIFAR-10 batches"):
        load_dataset(config, seed=0)


def test_digits_are_normalized_with_statistics_of_the_training_split():
    splits = load_dataset(DataConfig(dataset="digits"), seed=0)
    assert splits.train_x.shape[1:] == (3, 32, 32)
    assert len(splits.train_x) + len(splits.val_x) == 1797
    torch.testing.assert_close(
        splits.train_x.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-4, rtol=0
    )
    assert set(splits.train_y.unique().tolist()) == set(range(10))
    again = load_dataset(DataConfig(dataset="digits"), seed=0)
    assert torch.equal(splits.val_y, again.val_y)  # the split is deterministic from the seed


def test_synthetic_data_is_learnable_not_noise():
    splits = load_dataset(DataConfig(dataset="synthetic", synthetic_samples=2000), seed=0)
    # A nearest-class-mean classifier fitted on train beats chance (0.1) by far on validation.
    means = torch.stack([splits.train_x[splits.train_y == c].mean(0) for c in range(10)])
    distances = torch.cdist(splits.val_x.flatten(1), means.flatten(1))
    accuracy = (distances.argmin(1) == splits.val_y).float().mean().item()
    assert accuracy > 0.5


@pytest.mark.parametrize(("n", "world_size"), [(40, 2), (41, 2), (30, 3)])
def test_rank_shards_cover_every_sample_once_per_epoch(n, world_size):
    x = torch.arange(n, dtype=torch.float32)
    epochs = []
    for epoch in range(2):
        seen = []
        for rank in range(world_size):
            loader, sampler = rank_train_loader(
                x,
                x.long(),
                rank=rank,
                world_size=world_size,
                batch_size=4,
                seed=1,
                drop_last=False,
                num_workers=0,
            )
            sampler.set_epoch(epoch)
            seen.append([int(i) for _, y in loader for i in y])
        flat = sorted(i for shard in seen for i in shard)
        # DistributedSampler pads with repeats up to a multiple of the world size.
        padded = -(-n // world_size) * world_size
        assert len(flat) == padded and set(flat) == set(range(n))
        epochs.append(seen)
    assert epochs[0] != epochs[1]  # reshuffled per epoch
    loader, sampler = rank_train_loader(
        x,
        x.long(),
        rank=0,
        world_size=world_size,
        batch_size=4,
        seed=1,
        drop_last=False,
        num_workers=0,
    )
    sampler.set_epoch(0)
    assert [int(i) for _, y in loader for i in y] == epochs[0][0]  # same seed, same batches
