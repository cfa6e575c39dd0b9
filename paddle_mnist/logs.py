"""`python -m paddle_mnist.logs`, the command as the docs spell it: its code is paddle_mnist.files.logs."""

import sys

from paddle_mnist.files.logs import main

if __name__ == "__main__":
    sys.exit(main())
