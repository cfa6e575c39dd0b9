"""`python -m paddle_mnist.export`, the command as the docs spell it: its code is paddle_mnist.deploy.export."""

import sys

from paddle_mnist.deploy.export import main

if __name__ == "__main__":
    sys.exit(main())
