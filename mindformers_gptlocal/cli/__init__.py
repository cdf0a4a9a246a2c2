"""The ``gptlocal`` command line (``main.py``), its arguments (``args.py``), the run_mindformer.py drop-in
(``launcher.py``) and the quickstart."""
from .main import main

__all__ = ["main"]
