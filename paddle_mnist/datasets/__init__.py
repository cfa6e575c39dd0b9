"""Images in: file readers, the in-memory datasets and batches, folders of your own images, augmentation, downloads
and checksums."""
