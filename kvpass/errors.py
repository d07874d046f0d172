"""Errors kvpass raises for input it cannot handle.

Every refusal is a ``KVPassError``, and also the builtin a caller would catch for it: ``InvalidValue`` is a
``ValueError``, ``InvalidType`` a ``TypeError``, ``UnsupportedModel`` a ``ValueError``. Each names the argument
(``.argument``), the value it got and what is allowed; the table of every refusal is
``kvpass.validation.RULES`` (docs/errors.md is generated from it). Two are not about an argument's value:
``ModelInUse`` (a second thread called ``generate`` on a model already generating) and ``OutOfDeviceMemory``
(the prompt, batch and cache do not fit), both ``RuntimeError``s.
"""

from __future__ import annotations


class KVPassError(Exception):
    """Base of every error kvpass raises on purpose. ``argument``: the argument refused (or None)."""

    argument: str | None = None

    def __init__(self, message: str, argument: str | None = None) -> None:
        super().__init__(message)
        self.argument = argument


class InvalidValue(KVPassError, ValueError):
    """An argument of the right type with a value kvpass does not accept."""


class InvalidType(KVPassError, TypeError):
    """An argument of a type kvpass does not accept."""


class UnsupportedModel(InvalidValue):
    """The model's attention could not be found, or was found in a form kvpass cannot rewrite."""

    def __init__(self, message: str, argument: str | None = "model") -> None:
        super().__init__(message, argument)


class ModelInUse(KVPassError, RuntimeError):
    """``generate`` was called on a KVPassModel that another thread is generating with."""


class OutOfDeviceMemory(KVPassError, RuntimeError):
    """The prompt, batch and compressed cache need more device memory than is free (estimated before the
    prefill, or a CUDA out-of-memory error during generate); the session was freed."""
