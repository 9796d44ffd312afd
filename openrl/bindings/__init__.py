"""Thin transports around a Function (see docs/internals.md): JetStream pull consumer and HTTP receiver."""

import importlib


def load_function(module: str):
    """Import ``module`` (e.g. ``functions.trainer``) and return its ``new()`` Function instance."""
    return importlib.import_module(module).new()
