"""Build glue pyproject.toml cannot express.

- The package list is discovered, never written by hand: every directory under
  ``ascend_patch/`` is a package of the wheel (a hand list dropped two of them), plus the
  manifest, which lives in ``patches/`` and ships as ``ascend_patch.patches``. pyproject's
  ``packages.find`` cannot add that mapped package to what it finds.
- The bootstrap .pth must land in site-packages itself, beside (not inside) the package,
  for both regular wheels and PEP 660 editable wheels. Its name sorts after
  ``__editable__*.pth`` so that, in an editable install, the package is importable by
  the time our line runs.
"""

from pathlib import Path

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = Path(__file__).parent / "ascend_patch" / "a1_ascend_patch.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(str(PTH), str(Path(self.build_lib) / PTH.name), preserve_mode=False)


class _AddPth:
    """Wraps setuptools' editable strategy to also write the .pth into the wheel."""

    def __init__(self, strategy):
        self._strategy = strategy

    def __enter__(self):
        self._strategy.__enter__()
        return self

    def __exit__(self, *exc_info):
        return self._strategy.__exit__(*exc_info)

    def __call__(self, wheel, files, mapping):
        self._strategy(wheel, files, mapping)
        wheel.writestr(PTH.name, PTH.read_bytes())


class EditableWheelWithPth(editable_wheel):
    def _select_strategy(self, *args, **kwargs):
        return _AddPth(super()._select_strategy(*args, **kwargs))


PACKAGES = [
    *find_namespace_packages(include=["ascend_patch", "ascend_patch.*"], exclude=["*.__pycache__"]),
    "ascend_patch.patches",
]

setup(packages=PACKAGES, cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
