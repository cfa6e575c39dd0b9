"""`python -m paddle_mnist.preflight`, the command as the docs spell it: its code is paddle_mnist.runtime.preflight."""

import sys

from paddle_mnist.runtime.preflight import main

if __name__ == "__main__":
    sys.exit(main())
