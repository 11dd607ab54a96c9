"""MorphServe's serving runtime.

Importing the package sets an OpenMP default for this process and the ones it starts, unless the environment
already has a wait policy: ``OMP_WAIT_POLICY=ACTIVE`` with ``GOMP_SPINCOUNT=200000``. Torch's OpenMP runtime (libgomp)
reads them once, when torch is first imported, so the package must be imported before torch for them to apply
(every entry point, ``python -m serve...`` and the Triton / Dynamo launchers, does that).

Why: a decode step runs ~120 short parallel regions (one per projection). With libgomp's default, the worker
thread goes to sleep between them on this kind of VM and every region pays a wake-up; spinning briefly
instead doubles quantized batch-1 decode on the 2-core AMD EPYC 9004 (static-int4 ~45 -> ~95 tok/s, README
"Threads"). The bounded spin (a few milliseconds) keeps an idle server from burning a core: unbounded ACTIVE
spins for minutes. Export ``OMP_WAIT_POLICY`` (``PASSIVE`` or ``ACTIVE``) to choose for yourself.
"""

import os

OMP_DEFAULTS = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "200000"}
INHERITED_OMP = frozenset(name for name in OMP_DEFAULTS if name in os.environ)
"""The OpenMP settings this process was started with (kept as they are), as opposed to the defaults set here."""

if "OMP_WAIT_POLICY" not in os.environ:
    for _name, _value in OMP_DEFAULTS.items():
        os.environ.setdefault(_name, _value)
