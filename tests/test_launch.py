"""Launch facts and device checks (launch.py): the GPU count per node."""

from __future__ import annotations

from paddle_mnist.launch import gpu_shortfall


def test_more_workers_than_gpus_is_refused_with_the_fix():
    """The GPU check's logic; the GPU path itself cannot run on these CPU-only machines."""
    assert gpu_shortfall(4, 4) is None and gpu_shortfall(2, 8) is None
    message = gpu_shortfall(4, 2)
    assert "4 workers were started on this node but only 2 GPU(s) are visible" in message
    assert "list at most 2 of the visible GPUs' labels in --gpus" in message
