"""``python -m serve.model.kernels``: build (or load the cached build of) the CPU kernels, every ISA variant the
CPU lists (each probed in a child process, serve/model/kernels/isa.py), and say which kernels the layers will run
on. ``make install`` runs it, so the first engine start does not compile; it exits 0 when a build fails (the
layers then use the AVX2 baseline, or torch's kernels, with a warning)."""

from __future__ import annotations

import logging

from serve.model import kernels

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    chosen = kernels.describe()
    for name, variant in kernels.isa.VARIANTS.items():
        usable = kernels.cpu_supported() and kernels.variant_ops(name) is not None
        print(f"  {name}: {'usable' if usable else 'not usable here'} (build: {kernels.build_dir(variant)})")
    print(f"quantized CPU kernels: {chosen}")
