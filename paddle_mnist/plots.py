"""`python -m paddle_mnist.plots`, the command as the docs spell it: its code is paddle_mnist.files.plots."""

import sys

from paddle_mnist.files.plots import main

if __name__ == "__main__":
    sys.exit(main())
