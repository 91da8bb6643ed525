"""The digits data set of the training jobs: a fixed split, standardized, sharded by rank.

scikit-learn ships the data (1797 8x8 images of the digits 0-9), so nothing is
downloaded at run time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SPLIT_SEED = 0  # the train/test split is fixed: every run is scored on the same test set
TEST_FRACTION = 0.2


@dataclass(frozen=True)
class Digits:
    """Standardized float32 inputs (n, 64) and int64 labels, train and test."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def n_features(self) -> int:
        return self.x_train.shape[1]

    @property
    def n_classes(self) -> int:
        return 10


def load_digits() -> Digits:
    """Return the digits data set, split 80/20 (stratified, fixed) and standardized.

    Pixels are standardized with the training set's mean and standard deviation
    (pixels that are constant in the training set are only centered).

    Raises:
        RuntimeError: scikit-learn is not installed.
    """
    try:
        from sklearn.datasets import load_digits as _load
        from sklearn.model_selection import train_test_split
    except ImportError as e:
        raise RuntimeError(
            "the training jobs need scikit-learn (digits data set): pip install 'mpicomp[jobs]'"
        ) from e
    x, y = _load(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=TEST_FRACTION, random_state=SPLIT_SEED, stratify=y
    )
    mean = x_train.mean(axis=0)
    std = x_train.std(axis=0)
    std[std == 0] = 1.0
    norm = lambda a: ((a - mean) / std).astype(np.float32)  # noqa: E731
    return Digits(norm(x_train), y_train.astype(np.int64), norm(x_test), y_test.astype(np.int64))


def local_batch_size(batch: int, rank: int, size: int) -> int:
    """Return this rank's part of a global batch of ``batch`` samples split over ``size`` ranks."""
    return batch // size + (1 if rank < batch % size else 0)


def batch_split(batch: int, size: int) -> str:
    """Return the ranks' parts of a global batch of ``batch`` over ``size`` ranks: ``16``,
    or ``10-11`` where they differ by one."""
    lo, hi = local_batch_size(batch, size - 1, size), local_batch_size(batch, 0, size)
    return str(lo) if lo == hi else f"{lo}-{hi}"


class ShardSampler:
    """Draw this rank's mini-batches from its own shard of the training set.

    The training set is cut into ``size`` contiguous shards (the split is already
    shuffled); each rank walks through a fresh permutation of its shard every epoch,
    drawn from (seed, rank), so a re-run with the same seed sees the same batches.

    Args:
        n_train: number of training samples.
        batch: the global batch size (split over the ranks; at least ``size``).
        rank: this rank.
        size: number of ranks.
        seed: seed of the per-epoch permutations.
    """

    def __init__(self, n_train: int, batch: int, rank: int, size: int, seed: int):
        if batch < size:
            raise ValueError(f"batch must be at least the number of ranks ({size}), got {batch!r}")
        self.shard = np.array_split(np.arange(n_train), size)[rank]
        self.local = local_batch_size(batch, rank, size)
        if self.local > self.shard.size:
            raise ValueError(
                f"batch {batch!r} needs {self.local} samples per rank; the shard has {self.shard.size}"
            )
        self._rng = np.random.default_rng([seed, rank])
        self._order = self._rng.permutation(self.shard)
        self._pos = 0

    def next(self) -> np.ndarray:
        """Return the indices of this rank's next mini-batch."""
        if self._pos + self.local > self._order.size:
            self._order = self._rng.permutation(self.shard)
            self._pos = 0
        idx = self._order[self._pos : self._pos + self.local]
        self._pos += self.local
        return idx
