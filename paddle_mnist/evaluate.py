"""`python -m paddle_mnist.evaluate`, the command as the docs spell it: its code is paddle_mnist.training.evaluate."""

import sys

from paddle_mnist.training.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
