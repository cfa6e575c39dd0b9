"""`python -m paddle_mnist.launch`, the command as the docs spell it: its code is paddle_mnist.runtime.launch."""

import sys

from paddle_mnist.runtime.launch import main

if __name__ == "__main__":
    sys.exit(main())
