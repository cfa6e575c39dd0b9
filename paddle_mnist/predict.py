"""`python -m paddle_mnist.predict`, the command as the docs spell it: its code is paddle_mnist.deploy.predict."""

import sys

from paddle_mnist.deploy.predict import main

if __name__ == "__main__":
    sys.exit(main())
