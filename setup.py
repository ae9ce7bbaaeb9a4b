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

import base64
import hashlib
import zipfile
from pathlib import Path

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = Path(__file__).parent / "ascend_patch" / "a1_ascend_patch.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(str(PTH), str(Path(self.build_lib) / PTH.name), preserve_mode=False)


def add_to_wheel_root(wheel: Path, name: str, data: bytes) -> None:
    """Add the file ``name`` at the root of ``wheel`` and to its RECORD (the wheel format,
    PEP 427: a zip whose RECORD lists every other file with its sha256 and size)."""
    with zipfile.ZipFile(wheel) as original:
        members = [(info, original.read(info)) for info in original.infolist()]
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    rewritten = wheel.with_name(wheel.name + ".part")
    with zipfile.ZipFile(rewritten, "w", zipfile.ZIP_DEFLATED) as out:
        for info, content in members:
            if info.filename.endswith(".dist-info/RECORD"):
                out.writestr(name, data)  # RECORD stays the last member
                content += f"{name},sha256={digest},{len(data)}\n".encode()
            out.writestr(info, content)
    rewritten.replace(wheel)


class EditableWheelWithPth(editable_wheel):
    """setuptools' editable wheel, with the .pth added once it is built: no option of the
    command puts a file at an editable wheel's root (its strategies write only their own), so
    the finished wheel, in the command's ``dist_dir``, gets it."""

    def run(self):
        super().run()
        for wheel in Path(self.dist_dir).glob("*.whl"):
            with zipfile.ZipFile(wheel) as built:
                names = built.namelist()
            if PTH.name not in names and any(n.startswith("__editable__") for n in names):
                add_to_wheel_root(wheel, PTH.name, PTH.read_bytes())


PACKAGES = [
    *find_namespace_packages(include=["ascend_patch", "ascend_patch.*"], exclude=["*.__pycache__"]),
    "ascend_patch.patches",
]

setup(packages=PACKAGES, cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
