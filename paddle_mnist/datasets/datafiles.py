"""The datasets' files on disk: where they live, what they are called, and the SHA256SUMS list that vouches for them.

Below both data (which reads and checks them) and download (which fetches, builds and lists them), so neither
has to import the other to know a file's name or digest.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from paddle_mnist.datasets.formats import DataError

SUMS = "SHA256SUMS"  # in each dataset folder: the files' SHA-256 digests, in sha256sum's format
IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
CIFAR_ARCHIVE = "cifar-10-python.tar.gz"
MNIST_JSON = "mnist.json.gz"
CHUNK = 1 << 20  # bytes read at a time when hashing, so a file of any size is hashed in little memory


def _default_data_root() -> Path:
    """The checkout's data/ (shipped datasets) when the package runs from a checkout; else ./data, where
    python -m paddle_mnist.download puts datasets when the package was installed with pip."""
    checkout = Path(__file__).resolve().parents[2]
    return checkout / "data" if (checkout / "pyproject.toml").is_file() else Path("data").resolve()


REPO_DATA = _default_data_root()


def file_digest(path: Path, algorithm: str) -> str:
    """The hex digest of a file's bytes by hashlib's algorithm ("sha256", "md5"), read in CHUNK blocks."""
    # usedforsecurity=False: MD5 checks integrity here, and FIPS-mode machines refuse MD5 otherwise
    digest = hashlib.new(algorithm, usedforsecurity=False)
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def read_sums(folder: Path) -> dict[str, str] | None:
    """folder/SHA256SUMS as {file name: lower-case SHA-256}, in the list's order, or None when there is no list.

    sha256sum's format: '<digest>  <name>', a '*' before the name in binary mode; blank lines are skipped. A line
    of another shape raises DataError: the list itself is damaged.
    """
    listing = Path(folder) / SUMS
    if not listing.is_file():
        return None
    listed = {}
    for number, line in enumerate(listing.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split(maxsplit=1)
        if len(parts) != 2:
            raise DataError(f"{listing}:{number}: want '<sha256>  <name>', found {line!r}; restore a good copy")
        listed[parts[1].strip().lstrip("*")] = parts[0].lower()
    return listed
