"""Dropout masks drawn by place in the global batch: a worker's share equals the whole batch's rows."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from paddle_mnist.network import dropout
from paddle_mnist.network.models import build_model


@pytest.mark.parametrize("units", [1, 7, 8, 9, 2304, 7201])
@pytest.mark.parametrize("workers", [2, 3, 4])
def test_each_share_of_a_batch_draws_the_rows_the_whole_batch_draws(units, workers):
    n = 12  # images per worker
    whole = dropout.keep_mask(dropout.Place(7, 40, 0, n * workers), 1, n * workers, units, 0.25)
    for rank in range(workers):
        share = dropout.keep_mask(dropout.Place(7, 40, rank * n, n * workers), 1, n, units, 0.25)
        np.testing.assert_array_equal(share, whole[rank * n : rank * n + n])


def test_masks_keep_one_minus_p_of_the_units_and_change_with_step_layer_and_seed():
    place = dropout.Place(7, 3, 0, 256)
    mask = dropout.keep_mask(place, 0, 256, 4000, 0.25)
    assert mask.shape == (256, 4000) and abs(mask.mean() - 0.75) < 0.005  # 1M draws: sd 0.0004
    assert abs(dropout.keep_mask(place, 0, 256, 4000, 0.5).mean() - 0.5) < 0.005
    others = [
        dropout.keep_mask(dropout.Place(7, 4, 0, 256), 0, 256, 4000, 0.25),  # next step
        dropout.keep_mask(place, 1, 256, 4000, 0.25),  # another layer
        dropout.keep_mask(dropout.Place(8, 3, 0, 256), 0, 256, 4000, 0.25),  # another seed
    ]
    for other in others:
        agree = (other == mask).mean()
        assert abs(agree - (0.75**2 + 0.25**2)) < 0.01  # independent draws agree by chance only


def test_a_place_outside_the_batch_is_refused():
    with pytest.raises(ValueError, match="not in a batch of 64"):
        dropout.keep_mask(dropout.Place(7, 0, 60, 64), 0, 8, 10, 0.5)


def test_a_model_split_across_workers_computes_the_whole_batch_s_outputs():
    """cifar_cnn (two Dropout(0.25) and a Dropout(0.5)) on 96 images, then on 3 shares of 32 at their places."""
    paddle.seed(1)
    model = build_model("cifar_cnn", 10, (3, 32, 32))
    model.train()
    found = dropout.layers(model)
    assert [layer.index for layer in found] == [0, 1, 2] and [layer.p for layer in found] == [0.25, 0.25, 0.5]
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((96, 3, 32, 32)).astype("float32"))
    with dropout.placed(found, dropout.Place(7, 3, 0, 96)):
        whole = model(x).numpy()
    shares = []
    for rank in range(3):
        with dropout.placed(found, dropout.Place(7, 3, 32 * rank, 96)):
            shares.append(model(x[32 * rank : 32 * rank + 32]).numpy())
    np.testing.assert_array_equal(np.concatenate(shares), whole)
    assert all(layer.place is None for layer in found)  # outside the block: paddle's own dropout
    model.eval()
    np.testing.assert_array_equal(model(x).numpy(), model(x).numpy())  # evaluation drops nothing


def test_the_layer_upscales_what_it_keeps():
    layer = dropout.Dropout(0.25)
    layer.train()
    x = paddle.ones([64, 500])
    with dropout.placed([layer], dropout.Place(7, 0, 0, 64)):
        out = layer(x).numpy()
    values = np.unique(out)
    assert len(values) == 2 and values[0] == 0.0 and values[1] == pytest.approx(1 / 0.75)
    assert abs((out == 0).mean() - 0.25) < 0.01
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        dropout.Dropout(1.5)
