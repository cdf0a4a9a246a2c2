"""The old home of ``register()``, now ``mf/registration.py``: kept because the ``.pth`` hook of an earlier install names it."""
from .mf.registration import register  # noqa: F401
