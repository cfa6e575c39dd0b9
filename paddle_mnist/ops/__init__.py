"""The oneDNN operators: their C++ sources (csrc/), their build, their start-up check and the Python calls into them."""
