"""Ships `sglang_oobguard.pth` at the root of site-packages (the import hook for sglang
releases without a plugin loader); pyproject.toml holds everything else."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "sglang_oobguard.pth"


class BuildWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(str(Path(__file__).parent / PTH), str(Path(self.build_lib) / PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


setup(cmdclass={"build_py": BuildWithPth})
