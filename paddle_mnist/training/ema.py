"""An exponential moving average of the weights (--ema): evaluated, saved and exported in place of the last weights."""

from __future__ import annotations

import paddle


def ema_decay(decay: float, step: int) -> float:
    """The decay at optimizer step `step` (1-based): ramped up from 0.1 so early averages are not stuck at the init.

    (1 + step) / (10 + step) reaches 0.99 after 890 steps and 0.999 after 8,990; below --ema it is what is used.
    """
    return min(decay, (1.0 + step) / (10.0 + step))


class WeightAverage:
    """A second copy of the network whose every float tensor (weights and batch norm statistics) follows the
    trained one's as avg = d * avg + (1 - d) * current after each optimizer step.

    Every rank updates its copy from identical weights, so the copies stay identical, except the batch norm
    statistics, which follow each rank's own and are averaged over workers with the trained network's.
    """

    def __init__(self, net: paddle.nn.Layer, copy: paddle.nn.Layer, decay: float):
        self.decay = decay
        self.net = copy
        self.net.set_state_dict(net.state_dict())
        for p in self.net.parameters():
            p.stop_gradient = True
        ours, theirs = self.net.state_dict(), net.state_dict()
        self._pairs = [(ours[k], theirs[k]) for k in ours if ours[k].is_floating_point()]

    @paddle.no_grad()
    def update(self, step: int) -> None:
        d = ema_decay(self.decay, step)
        for avg, current in self._pairs:
            paddle.assign(avg * d + current * (1.0 - d), output=avg)

    def state_dict(self) -> dict:
        return self.net.state_dict()

    def set_state_dict(self, state: dict) -> None:
        self.net.set_state_dict(state)
