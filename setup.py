"""Only job: ship ``mindformers_gptlocal_autoregister.pth`` into site-packages (metadata is in setup.cfg)."""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "mindformers_gptlocal_autoregister.pth"


class BuildPyWithPth(build_py):
    """Copy the .pth file to the root of the built package tree, beside the package."""

    def run(self):
        super().run()
        self.copy_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), PTH),
                       os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
