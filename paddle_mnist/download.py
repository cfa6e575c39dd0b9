"""`python -m paddle_mnist.download`, the command as the docs spell it: its code is paddle_mnist.datasets.download."""

import sys

from paddle_mnist.datasets.download import main

if __name__ == "__main__":
    sys.exit(main())
