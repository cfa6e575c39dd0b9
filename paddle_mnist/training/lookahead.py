"""Lookahead (--lookahead): a slow copy of the weights that the trained weights are pulled back to.

Every EVERY optimizer steps the slow copy moves toward the weights, slow = d * slow + (1 - d) * weights, and the
weights become the slow copy. d grows with the run, PER_STEP ** EVERY * (step / planned) ** 3: about 0 early, so
the weights train freely, and 0.77 at the end, where it averages out the last steps' noise. At the schedule's last
step the weights become the slow copy. The schedule is airbench94's (K. Jordan, 2024); the mirror measured the
lookahead worth 0.9 points there (docs/results.md, "The frontier").

Only the trained parameters have a slow copy: they are the same on every rank, so every rank's copy is the same
and rank 0's checkpoint resumes every rank exactly (batch norm's running statistics, each rank's own until they
are averaged, are left as they are).
"""

from __future__ import annotations

import paddle

EVERY = 5
PER_STEP = 0.95


def lookahead_decay(step: int, planned: int) -> float:
    """The slow copy's share kept at optimizer step `step` (1-based) of a schedule of `planned` steps."""
    return PER_STEP**EVERY * min(step / planned, 1.0) ** 3


class Lookahead:
    def __init__(self, net: paddle.nn.Layer):
        self._params = [(name, p) for name, p in net.named_parameters() if not p.stop_gradient]
        self.slow = {name: p.detach().clone() for name, p in self._params}

    @paddle.no_grad()
    def update(self, step: int, planned: int) -> None:
        """After optimizer step `step`: the pull every EVERY steps, and the weights set to the slow copy at the
        last step."""
        if step % EVERY == 0:
            d = lookahead_decay(step, planned)
            for name, p in self._params:
                slow = self.slow[name]
                paddle.assign(slow * d + p * (1.0 - d), output=slow)
                p.set_value(slow)
        if step == planned:
            for name, p in self._params:
                p.set_value(self.slow[name])

    def state_dict(self) -> dict:
        return dict(self.slow)

    def set_state_dict(self, state: dict, source: str) -> None:
        """The slow copy from a checkpoint; ValueError naming the first tensor that is missing or does not fit."""
        for name, p in self._params:
            saved = state.get(name)
            if saved is None or list(saved.shape) != list(p.shape):
                found = "missing" if saved is None else f"shape {list(saved.shape)}, the network's {list(p.shape)}"
                raise ValueError(f"{source}: the lookahead's copy of {name} does not fit: {found}")
            paddle.assign(paddle.to_tensor(saved, dtype=p.dtype), output=self.slow[name])
