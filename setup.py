"""Build step that installs the timm start-up hook next to the packages in site-packages.

Everything else about the build lives in pyproject.toml. ``build_py`` writes two start-up
files into the root of the built tree, both calling ``_timm_layerscale_autoload.install``:
``timm_layerscale.start`` (PEP 829 entry point) and ``timm_layerscale.pth`` (its ``import``
line form for Pythons without PEP 829; those with it skip a ``.pth`` file's ``import`` lines
when a ``.start`` file of the same name exists). A regular wheel carries them from
``build_lib``; an editable wheel (``pip install -e``) does not ship ``build_lib``, so there
they are written straight into the wheel's root, where setuptools also puts the files
that are not editable.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

HOOK_MODULE = "_timm_layerscale_autoload"
STARTUP_FILES = {
    "timm_layerscale.start": f"{HOOK_MODULE}:install\n",
    "timm_layerscale.pth": f"import {HOOK_MODULE}; {HOOK_MODULE}.install()\n",
}


class build_py_with_startup_files(build_py):
    def run(self):
        super().run()
        for name, text in STARTUP_FILES.items():
            self._write(os.path.join(self._startup_dir(), name), text)

    def _startup_dir(self):
        if not getattr(self, "editable_mode", False):
            return self.build_lib
        wheel_root = self.get_finalized_command("install").install_lib
        if not wheel_root:
            raise RuntimeError("editable build: setuptools gave no wheel root for the start-up files")
        return wheel_root

    def _write(self, path, text):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        return outputs + [os.path.join(self.build_lib, name) for name in STARTUP_FILES]


setup(cmdclass={"build_py": build_py_with_startup_files})
