"""paddle_mnist: a PaddlePaddle dygraph data-parallel trainer for image classification."""

__version__ = "0.1.0"
