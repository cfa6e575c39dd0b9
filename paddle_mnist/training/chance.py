"""Whether a run learned anything: chance levels of the training loss and the test accuracy, and the verdicts.

Chance is what a network scores that learned nothing but the class shares. Its training loss is the entropy of
the label shares (ln C for C balanced classes; label smoothing mixes a uniform share in); its accuracy is at most
the share of the commonest class, by always guessing it. A start that blows up sits at that loss from its first
steps on and never leaves it; labels that do not match the images leave the test accuracy there. Both verdicts
are computed from figures every rank holds alike (all-reduced sums, the labels), so all ranks stop together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# The stall is judged on an epoch that begins this many optimizer steps after the warmup ends: about 3x the 55 to 70
# steps the slowest default start measured (cifar_cnn on MNIST, docs/results.md's first steps) takes to get its
# loss to 1.5, two thirds of chance. Whole epochs after that point: an epoch that began in the first steps would
# average in an overshoot (a loss above chance) that the network recovers from.
STALL_STEPS = 200
# Stalled: the loss has gone less than 3% of the way from chance down to the least it can be. A network stuck on
# the class shares scores chance or a little above it; a learning one is far below by then.
STALL_SHARE = 0.97
# The final accuracy is judged once the run trained this many steps after its warmup: the default starts measured
# get their loss to two thirds of chance in 11 to 27 steps (cifar_cnn 35 to 70), and the bound below asks only for
# an accuracy clear of chance. Smoke runs of a few to a few dozen steps are not judged (a warning instead).
JUDGE_STEPS = 50
# Standard errors of sampling above the commonest class's share: an uninformed predictor scores at most that share
# on average, and passes this bound on fewer than 0.2% of test sets (one-sided normal approximation).
Z = 3.0


class LearnedNothing(RuntimeError):
    """The run ended at chance: its weights, results and checkpoints were written first."""


def shares(labels: np.ndarray, classes: int) -> np.ndarray:
    counts = np.bincount(np.asarray(labels, dtype=np.int64), minlength=classes).astype(np.float64)
    return counts / max(counts.sum(), 1.0)


def entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


@dataclass(frozen=True)
class LossLevels:
    """The training loss of a network that learned nothing (chance), and the least the loss can be (floor)."""

    chance: float
    floor: float  # above 0 only with label smoothing: a perfect network still pays for the smoothed targets
    classes: int

    @classmethod
    def of(cls, labels: np.ndarray, classes: int, smoothing: float = 0.0) -> LossLevels:
        """With smoothing e every target is (1 - e) one-hot + e / C (as paddle's cross_entropy makes it); the best
        constant prediction is then the mean target, and its loss that mean's entropy."""
        uniform = np.full(classes, 1.0 / classes)
        mean_target = (1 - smoothing) * shares(labels, classes) + smoothing * uniform
        one = (1 - smoothing) * np.eye(classes)[0] + smoothing * uniform
        return cls(chance=entropy(mean_target), floor=entropy(one), classes=classes)

    def stalled(self, loss: float) -> bool:
        return loss - self.floor >= STALL_SHARE * (self.chance - self.floor)

    def describe(self) -> str:
        """ln C = x when the shares are about even (or smoothed to it); else the figure, said to be the shares'."""
        even = math.log(self.classes)
        if self.chance > 0.99 * even:
            return f"ln {self.classes} = {even:.2f}"
        return f"{self.chance:.2f} (the entropy of the class shares; ln {self.classes} = {even:.2f} if they were even)"


def stall_judged(epoch_start: int, warmup_steps: int) -> bool:
    """An epoch that began STALL_STEPS or more steps after the warmup ended is judged on its mean loss."""
    return epoch_start >= warmup_steps + STALL_STEPS


@dataclass(frozen=True)
class AccuracyLevel:
    share: float  # of the commonest class among the evaluated images: the accuracy of always guessing it
    bound: float  # share plus Z standard errors of sampling: at or below it, no better than chance
    count: int

    @classmethod
    def of(cls, labels: np.ndarray, classes: int) -> AccuracyLevel:
        n = len(labels)
        p = float(shares(labels, classes).max()) if n else 1.0
        return cls(share=p, bound=p + Z * math.sqrt(p * (1 - p) / max(n, 1)), count=n)

    def at_chance(self, acc: float) -> bool:
        return bool(acc <= self.bound)  # a plain bool: the figures may be numpy's, results.json takes it


FIXES = (
    "start afresh (--overwrite) with a lower --lr or a warmup (--warmup-epochs 1), and check that each class "
    "folder holds only images of its class (labels that do not match the images teach nothing)"
)


def stall_message(levels: LossLevels, loss: float, step: int, epoch: int, out: str) -> str:
    return (
        f"the training loss stayed at chance level {levels.describe()} after {step} steps (epoch {epoch} mean "
        f"{loss:.3f}): the model learned nothing; {FIXES}; its weights, results and checkpoints are kept in {out}"
    )


def final_message(level: AccuracyLevel, acc: float, step: int, train_loss: str, out: str) -> str:
    return (
        f"the test accuracy {acc:.4f} on {level.count} images is no better than chance (the commonest class's share "
        f"{level.share:.4f}, {level.bound:.4f} with {Z:g} standard errors) after {step} steps{train_loss}: the model "
        f"learned nothing; {FIXES}; its weights and results are kept in {out}"
    )


def judge(acc: float, level: AccuracyLevel, steps: int, warmup_steps: int, stalled: bool) -> bool | None:
    """Learned nothing: True, a stall or a final accuracy no better than chance; False, better than chance; None,
    too few steps after the warmup to judge (a smoke run), or a test split that cannot tell a learner from chance
    (one class only, or a handful of images: the bound is 100% or more)."""
    if stalled:
        return True
    if steps < warmup_steps + JUDGE_STEPS or level.bound >= 1:
        return None
    return level.at_chance(acc)


@dataclass(frozen=True)
class Verdict:
    learned_nothing: bool | None  # None: too few steps to judge
    message: str | None  # the error's text when it learned nothing
    level: AccuracyLevel

    def fields(self) -> dict:
        """For results.json."""
        return {
            "learned_nothing": self.learned_nothing,
            "chance_acc": self.level.share,
            "chance_acc_bound": self.level.bound,
        }
