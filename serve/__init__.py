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

It also bounds oneDNN's caches of compiled matmuls, unless the environment already sets them:
``LRU_CACHE_CAPACITY`` (ideep's cache in torch) and ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` (oneDNN's own), both
``ONEDNN_CACHE_CAPACITY``. Batched fp32 CPU projections run oneDNN's matmul (serve/model/linear.py), and every
new row count (tokens in a step) compiles a new one for each weight shape: ~0.6 MiB each, kept up to the
default 1024 per cache, so a serving process grew by hundreds of MiB for as long as new batch shapes kept
coming (pytorch/pytorch#27971, #29893). A miss costs about 1 ms (one compile) on a step that takes
tens of ms at those row counts. oneDNN reads both once, at the process's first oneDNN op (not at torch's
import), so importing ``serve`` first is enough.
"""

import os

OMP_DEFAULTS = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "200000"}
INHERITED_OMP = frozenset(name for name in OMP_DEFAULTS if name in os.environ)
"""The OpenMP settings this process was started with (kept as they are), as opposed to the defaults set here."""

if "OMP_WAIT_POLICY" not in os.environ:
    for _name, _value in OMP_DEFAULTS.items():
        os.environ.setdefault(_name, _value)

ONEDNN_CACHE_CAPACITY = 128
"""Entries each oneDNN cache keeps: ~80 MiB at most (an entry, ~0.6 MiB, is held by both caches), and room for the
4 decoder projection shapes at every decode batch size up to max_num_seqs 32, so steady decoding does not thrash.
A 5-minute Azure-trace replay (87 row counts above 2) missed 408 of 2071 lookups at 128 against 352 at 1024."""
ONEDNN_CACHE_DEFAULTS = {"LRU_CACHE_CAPACITY": str(ONEDNN_CACHE_CAPACITY),
                         "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(ONEDNN_CACHE_CAPACITY)}
INHERITED_ONEDNN = frozenset(name for name in ONEDNN_CACHE_DEFAULTS if name in os.environ)
"""The oneDNN cache settings this process was started with (kept as they are)."""

for _name, _value in ONEDNN_CACHE_DEFAULTS.items():
    os.environ.setdefault(_name, _value)
