"""Benchmarks. The serving package is imported first so its OpenMP defaults (serve/__init__.py) are in place
before any benchmark imports torch."""

import serve  # noqa: F401
