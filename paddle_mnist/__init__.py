"""paddle_mnist: a PaddlePaddle dygraph data-parallel trainer for image classification."""

# Python's zlib before Paddle: Paddle 2.6's core library carries a zlib of its own, and when it is loaded first,
# gzip decompression (the idx datasets) crashes in inflateReset2 or fails with "inconsistent stream state".
import zlib  # noqa: F401

__version__ = "0.1.0"


def __getattr__(name: str):
    """paddle_mnist.train, paddle_mnist.Predictor and paddle_mnist.load_model, imported when first asked for, so
    that importing the package loads no Paddle."""
    if name == "Predictor":
        from paddle_mnist.deploy.predictor import Predictor

        return Predictor
    if name == "train":
        from paddle_mnist.training.api import train

        return train
    if name == "load_model":
        from paddle_mnist.deploy.weights import load_model

        return load_model
    raise AttributeError(f"module 'paddle_mnist' has no attribute {name!r}")
