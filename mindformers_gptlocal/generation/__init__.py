"""Generation's host side, pure Python and numpy: the one table of defaults (``defaults.py``), options
(``loop.resolve_options``), the temperature rule and sampling (``sampling.py``), when a sequence stops
(``stopping.py``: the rule of the decode loop and of the server's scheduler alike) and the decode loop (``loop.py``)
over any step function.
Imports nothing from ``model/``; what runs the model (``generate``, the KV cache's compiled graphs) is
``runtime/``."""
from .loop import resolve_options

__all__ = ["resolve_options"]
