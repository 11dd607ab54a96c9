"""``python -m bench.llamacpp_flags``: the CMake flags ``make bench-peer`` builds llama.cpp with, from what this
machine was found to execute (the ISA probe of our own kernels, serve/model/kernels/isa.py), instead of
``GGML_NATIVE=ON`` (``-march=native`` trusts cpuid: on an AVX-512 host listing AMX, llama.cpp built that way died
with SIGILL on ``tileloadd``). AMX stays off; AVX-512 (with VNNI) only where our AVX-512 variant's probe
executed. Prints the flags on one line (the Makefile passes them as ``CMAKE_ARGS``) and says why on stderr.
"""

from __future__ import annotations

import sys

from serve.model import kernels
from serve.model.kernels import isa

BASE = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON",
        "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
AVX512 = ["-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON"]
NO_AVX512 = ["-DGGML_AVX512=OFF", "-DGGML_AVX512_VNNI=OFF"]


def flags(avx512_usable: bool) -> list[str]:
    """llama.cpp's CPU flags for a machine that executes AVX2 + FMA, and AVX-512 F/BW/VL/VNNI or not."""
    return BASE + (AVX512 if avx512_usable else NO_AVX512)


def main() -> int:
    avx512 = kernels.cpu_supported() and kernels.variant_ops(isa.AVX512.name) is not None
    chosen = flags(avx512)
    why = "the AVX-512 variant's probe executed" if avx512 else "no usable AVX-512 variant here"
    print(f"llama.cpp CMake flags ({why}; AMX off; {isa.machine_id()}): {' '.join(chosen)}", file=sys.stderr)
    print(" ".join(chosen))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
