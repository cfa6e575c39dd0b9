"""The training step's arithmetic (engine.py): gradient norms, with fp16 overflow steps left out and counted."""

from __future__ import annotations

import paddle
import pytest

from paddle_mnist.training import engine


def gradients_with(value: float | None) -> list:
    """A small network's real gradients; value (inf, NaN) injected into one element, as an fp16 overflow leaves
    them after GradScaler.unscale_."""
    paddle.seed(0)
    net = paddle.nn.Linear(4, 3)
    net(paddle.randn([8, 4])).sum().backward()
    if value is not None:
        grad = net.weight.grad.numpy()
        grad[1, 2] = value
        paddle.assign(paddle.to_tensor(grad), output=net.weight.grad)
    return net.parameters()


def test_overflow_steps_are_left_out_of_the_norm_figures_and_counted_as_skipped():
    finite = engine.global_grad_norm(gradients_with(None))
    tally = engine.NormTally(clip=float(finite) / 2)  # every finite step is clipped
    for value in (None, float("inf"), None, float("nan")):
        norm = engine.global_grad_norm(gradients_with(value))
        assert bool(paddle.isfinite(norm)) == (value is None)
        tally.add(norm)
    assert (int(tally.clipped), int(tally.skipped)) == (2, 2)
    assert tally.mean() == pytest.approx(float(finite), rel=1e-6)
    fields = {"loss": 0, "acc": 0, "images": 0, "seconds": 1, "input_wait": 0, "own_seconds": 1}
    stats = engine.EpochStats(**fields, steps=4, phase_shares={}, samples=0, clipped=2, grad_norm=1.0, skipped=2)
    assert stats.clipped_share == 1.0
