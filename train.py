"""Entry point: python train.py [options], or under python -m paddle.distributed.launch."""

import sys

from paddle_mnist.start import main

if __name__ == "__main__":
    sys.exit(main())
