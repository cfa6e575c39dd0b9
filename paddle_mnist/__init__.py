"""paddle_mnist: a PaddlePaddle dygraph data-parallel trainer for image classification."""

# Python's zlib before Paddle: Paddle 2.6's core library carries a zlib of its own, and when it is loaded first,
# gzip decompression (the idx datasets) crashes in inflateReset2 or fails with "inconsistent stream state".
import zlib  # noqa: F401

__version__ = "0.1.0"
