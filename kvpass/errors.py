"""Errors kvpass raises for input it cannot handle."""


class UnsupportedModel(ValueError):
    """The model's attention could not be found, or was found in a form kvpass cannot rewrite."""
