"""The one error type a request's inputs are refused with (its message goes back to the client verbatim).

Its own module so that request parsing (``request_inputs.py``) and TensorRT-LLM's contract (``trtllm.py``)
both use it without importing each other in a circle."""

from __future__ import annotations


class InputError(ValueError):
    """A request the model refuses; the message goes back to the client verbatim."""
