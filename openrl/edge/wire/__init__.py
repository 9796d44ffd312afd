"""Pydantic v2 models of the JSON bodies spoken with the tinker 0.38.0 SDK.

* ``openrl.edge.wire.requests``  — request bodies (an unknown field is refused naming it, ``type`` never required)
* ``openrl.edge.wire.responses`` — response bodies (serialize with :func:`dump`)
* ``openrl.edge.wire.common``    — ModelInput / chunks, TensorData, LoraConfig, OptimizerConfig
* :func:`parse_request` and :func:`validation_error_to_user_error` turn bad input into
  ``UserError(field, message)`` naming a dotted field path.

Everything is re-exported here: ``from openrl.edge.wire import SampleRequest``.
"""

from ._base import FieldError, ResponseModel, WireModel, dump, parse_request, validation_error_to_user_error
from .common import *  # noqa: F401,F403
from .common import __all__ as _common_all
from .requests import *  # noqa: F401,F403
from .requests import __all__ as _requests_all
from .responses import *  # noqa: F401,F403
from .responses import __all__ as _responses_all

__all__ = [
    "FieldError", "ResponseModel", "WireModel", "dump", "parse_request",
    "validation_error_to_user_error",
    *_common_all, *_requests_all, *_responses_all,
]
