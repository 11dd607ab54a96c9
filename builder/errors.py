"""User-facing build errors: the CLI prints their message on one line and exits with status 2."""

from __future__ import annotations


class BuildError(Exception):
    """Bad input to the builder (model source, group size, precision, output directory, calibration text)."""
