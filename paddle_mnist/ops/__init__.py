"""The CPU operators, oneDNN's and an SSE2 max-pool: their C++ sources (csrc/), their build (onednn), their start-up
check (selfcheck) and the one seam the networks call them through (fastpath)."""
