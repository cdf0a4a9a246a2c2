"""``python -m mindformers_gptlocal.cli ...`` is ``gptlocal ...``."""
import sys

from .main import main

sys.exit(main())
