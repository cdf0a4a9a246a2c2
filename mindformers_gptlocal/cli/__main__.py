"""``python -m mindformers_gptlocal.cli ...`` is ``gptlocal ...``."""
import sys

# absolute: MindSpore's compile cache scans the entry script's imports and fails on a relative one
# (ImportError: no package specified for '.main.main')
from mindformers_gptlocal.cli.main import main

sys.exit(main())
