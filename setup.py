"""Everything about the package is in pyproject.toml; this file only ships zerodp_as_deepspeed.pth.

setuptools installs no .pth file by itself, so build_py copies it to the top of the wheel (site-packages),
and editable_wheel puts it in the editable wheel. The .pth imports `_zerodp_as_deepspeed` at interpreter
start-up only when ZERODP_AS_DEEPSPEED is set (see that module).
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "zerodp_as_deepspeed.pth"


class build_py_with_pth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


class editable_wheel_with_pth(editable_wheel):
    # An editable wheel holds what this hook puts in its unpacked directory, not build_py's outputs.
    def _install_namespaces(self, installation_dir, pth_prefix) -> None:
        super()._install_namespaces(installation_dir, pth_prefix)
        shutil.copy(PTH, os.path.join(installation_dir, PTH))


setup(cmdclass={"build_py": build_py_with_pth, "editable_wheel": editable_wheel_with_pth})
