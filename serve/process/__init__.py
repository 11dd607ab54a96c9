"""Process tuning for a serving process: the C heap's free pages back to the OS (``heap.py``) and one OpenMP thread
team per process (``omp_threads.py``). The OpenMP and oneDNN environment defaults that must be set before torch
loads stay in serve/__init__.py (importing the package is what applies them)."""
