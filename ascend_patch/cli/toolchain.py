"""The Ascend stack outside Python: CANN toolkit, NNAL (ATB), driver and SoC.

Found from install files, the variables their ``set_env.sh`` scripts export, and ``npu-smi``,
never by importing torch_npu (``doctor`` must answer on a machine where that import breaks):

- CANN: ``version.cfg`` / ``ascend_toolkit_install.info`` under ``ASCEND_TOOLKIT_HOME`` or
  ``ASCEND_HOME_PATH`` (``ascend-toolkit/set_env.sh``), else ``/usr/local/Ascend/ascend-toolkit/latest``.
- NNAL: torch_npu runs its ATB ops through ``lib/libop_plugin_atb.so``, which links NNAL's
  ``libatb.so``; torch_npu imports without it and the first ATB call raises ("Please check that
  the nnal package is installed", ``torch_npu/op_plugin/atb/_atb_ops.py``). NNAL installs under
  ``/usr/local/Ascend/nnal/atb``; its ``set_env.sh`` exports ``ATB_HOME_PATH``
  (``.../atb/latest/atb/cxx_abi_N``) and puts ``libatb.so`` on ``LD_LIBRARY_PATH``, which the
  dynamic loader needs (vllm-ascend's installation guide sources it; NNAL == CANN's version).
  Its version is the ``Ascend-cann-atb`` line of ``nnal/atb/latest/version.info``.
- driver: the ``Version=`` line of ``/usr/local/Ascend/driver/version.info``.
- SoC: ``npu-smi info -t board -i ID [-c 0]`` (Chip Type, Chip Name, NPU Name), named and
  grouped into families as vllm-ascend's ``setup.py`` and ``device/hardware.py`` do.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

ASCEND_ROOT = Path("/usr/local/Ascend")
NNAL_ROOT = ASCEND_ROOT / "nnal" / "atb"
NNAL_SET_ENV = NNAL_ROOT / "set_env.sh"
DRIVER_INFO = ASCEND_ROOT / "driver" / "version.info"
_CANN_INFO_FILES = ("version.cfg", "ascend_toolkit_install.info")
# The calls of ascend_patch/npu/kernels/npu.py that torch_npu runs through ATB, so need NNAL, by
# the path that launches them; every other op there is an aclnn op of the CANN toolkit.
ATB_OPS = {
    "_npu_paged_attention": "decode of full-attention layers, eager and in ACL graphs",
    "_npu_paged_attention_get_workspace": "ACL graph capture of that decode",
    "atb.npu_multi_head_latent_attention": "MLA decode (DeepSeek-V2/V3)",
}


def _value(path: Path, keys: tuple[str, ...]) -> str | None:
    """The value of the first ``key=value`` or ``key : value`` line whose key is one of ``keys``."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        match = re.match(r"\s*([^=:]+?)\s*[=:]\s*(.*?)\s*$", line)
        if match and match.group(1) in keys and match.group(2):
            return match.group(2)
    return None


def cann_version() -> str | None:
    """The CANN toolkit version from its install info, if a toolkit is present."""
    home = os.environ.get("ASCEND_TOOLKIT_HOME") or os.environ.get("ASCEND_HOME_PATH")
    roots = [Path(home)] if home else []
    roots.append(ASCEND_ROOT / "ascend-toolkit" / "latest")
    for root in roots:
        for info in (p for name in _CANN_INFO_FILES for p in root.glob(f"**/{name}")):
            version = _value(info, ("version", "Version"))
            if version:
                return version
    return None


def driver_version() -> str | None:
    return _value(DRIVER_INFO, ("Version",))


def nnal() -> dict:
    """Where NNAL's ``libatb.so`` is, its version, and whether the dynamic loader will find it."""
    home = os.environ.get("ATB_HOME_PATH")
    homes = [Path(home)] if home else []
    homes += sorted((NNAL_ROOT / "latest" / "atb").glob("cxx_abi_*"))
    library = next((h / "lib" / "libatb.so" for h in homes if (h / "lib" / "libatb.so").is_file()), None)
    search = [Path(d) for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    loadable = library is not None and any((d / "libatb.so").is_file() for d in search)
    version = None
    for info in ([Path(home).parent.parent / "version.info"] if home else []) + [NNAL_ROOT / "latest" / "version.info"]:
        version = version or _value(info, ("Ascend-cann-atb", "version", "Version"))
    return {"found": library is not None, "version": version,
            "libatb": str(library) if library else None, "on_library_path": loadable,
            "set_env": str(NNAL_SET_ENV)}


def _npu_smi(*args: str) -> dict[str, str]:
    """``key : value`` lines of one ``npu-smi info`` call ({} when it cannot run)."""
    try:
        out = subprocess.run(["npu-smi", "info", *args], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    pairs = (line.split(":", 1) for line in out.splitlines() if ":" in line)
    return {key.strip(): value.strip() for key, value in pairs}


def family(soc: str | None = None, soc_version: int | None = None) -> str | None:
    """The hardware family of a SoC name (``Ascend910B3``) or torch_npu's numeric SoC version."""
    if soc_version is not None:
        ranges = {"A2": range(220, 226), "A3": range(250, 256), "310P": range(200, 206), "A5": range(260, 261)}
        return next((name for name, span in ranges.items() if soc_version in span), None)
    name = (soc or "").lower()
    for marker, found in (("950", "A5"), ("910b", "A2"), ("910_93", "A3"), ("310p", "310P")):
        if marker in name:
            return found
    return None


def soc() -> dict | None:
    """The first NPU's SoC as ``npu-smi`` names it, or None without npu-smi."""
    if shutil.which("npu-smi") is None:
        return None
    npu_id = _npu_smi("-l").get("NPU ID", "0")
    board = _npu_smi("-t", "board", "-i", npu_id)
    if "Chip Name" not in board:  # A2/A3/310P name the chip per chip
        board = _npu_smi("-t", "board", "-i", npu_id, "-c", "0")
    chip, kind, npu = board.get("Chip Name", ""), board.get("Chip Type", ""), board.get("NPU Name", "")
    if not chip:
        return {"soc": None, "family": None, "source": "npu-smi (no Chip Name)"}
    name = kind + chip if kind else f"{chip}_{npu}" if npu else chip
    return {"soc": name, "family": family(name), "source": "npu-smi"}
