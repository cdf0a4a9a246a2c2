"""Only job: ship ``mindformers_gptlocal_autoregister.pth`` into site-packages, for ``pip install .`` and
``pip install -e .`` alike (metadata is in setup.cfg). The .pth line registers gpt_local whenever
``mindformers`` is imported."""
import os
import warnings

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PTH = "mindformers_gptlocal_autoregister.pth"


class BuildPyWithPth(build_py):
    """Regular install: copy the .pth file to the root of the built tree, beside the package."""

    def run(self):
        super().run()
        self.copy_file(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


def _editable_wheel_with_pth():
    """Editable install (PEP 660): setuptools writes only its own path hook into the editable wheel and
    leaves out files that build_py copies, so the wheel gets the .pth added here. ``_select_strategy`` is
    setuptools' one place that picks what goes into that wheel (setuptools >= 64, see pyproject.toml)."""
    from setuptools.command.editable_wheel import editable_wheel

    class _AddPth:
        def __init__(self, strategy):
            self.strategy = strategy

        def __call__(self, wheel, files, mapping):
            self.strategy(wheel, files, mapping)
            with open(os.path.join(HERE, PTH), encoding="utf-8") as handle:
                wheel.writestr(PTH, handle.read())

        def __enter__(self):
            self.strategy.__enter__()
            return self

        def __exit__(self, *exc):
            return self.strategy.__exit__(*exc)

    class EditableWheelWithPth(editable_wheel):
        def _select_strategy(self, *args, **kwargs):
            return _AddPth(super()._select_strategy(*args, **kwargs))

    return EditableWheelWithPth


try:  # setuptools' notice that an editable install uses a path finder: informational, not a problem here
    from setuptools.warnings import InformationOnly
    warnings.filterwarnings("ignore", category=InformationOnly)
except ImportError:
    pass

setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": _editable_wheel_with_pth()})
