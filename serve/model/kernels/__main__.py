"""``python -m serve.model.kernels``: build (or load the cached build of) the quantized CPU kernels and say
which kernels the quantized layers will run on. ``make install`` runs it, so the first engine start does
not compile; it exits 0 when the build fails (the layers then use torch's kernels, with a warning)."""

from __future__ import annotations

import logging

from serve.model import kernels

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"quantized CPU kernels: {kernels.describe()} (build: {kernels.build_dir()})")
