"""``python -m serve.model.kernels.probe_child '<variant json>'``: the child process of the ISA probe
(serve/model/kernels/isa.py). Builds the variant (or loads its cached build), calls its ``probe()`` and prints
the checksum. A CPU that does not execute one of its instructions kills this process (SIGILL), not the server;
exit 3 means the build failed (not the CPU's verdict)."""

from __future__ import annotations

import sys

from serve.model import kernels
from serve.model.kernels.isa import Variant


def main(argv: list[str]) -> int:
    variant = Variant.from_json(argv[1])
    try:
        module = kernels.build(variant=variant)
    except Exception as exc:  # noqa: BLE001 - any build failure: reported, the parent falls back
        print(f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[-1]}")
        return 3
    print(module.probe(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
