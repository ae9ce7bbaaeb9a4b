"""``ascend-patch collect-env``: what a bug report needs, as one JSON document.

Versions (Python, vLLM, torch, torch-npu, transformers), the Ascend stack (CANN, NNAL, driver,
SoC), the settings, doctor's report and the last verify record. Nothing private: the home
directory is written ``~``, and of the environment only ``ASCEND_PATCH*`` and ``VLLM_*``
names are kept, without any whose name suggests a credential or an address.
"""

from __future__ import annotations

import json
import os
import platform as host
import re
from pathlib import Path

from ascend_patch import __version__
from ascend_patch.cli import output, toolchain
from ascend_patch.overlay import version as versions

_PRIVATE = re.compile(r"KEY|TOKEN|SECRET|PASS|AUTH|CRED|URL|HOST|ADDR|IP$|ENDPOINT", re.IGNORECASE)


def settings() -> dict[str, str]:
    return {name: value for name, value in sorted(os.environ.items())
            if name.startswith(("ASCEND_PATCH", "VLLM_")) and not _PRIVATE.search(name)}


def _redacted(data):
    """``data`` with the home directory written as ``~`` in every string."""
    home = os.path.expanduser("~")
    text = json.dumps(data)
    if home not in ("", "/"):
        text = text.replace(json.dumps(home)[1:-1], "~")
    return json.loads(text)


def _record(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def collect(record: Path) -> dict:
    from ascend_patch.cli import doctor

    return output.document("collect-env", _redacted({
        "ascend_patch": __version__,
        "python": host.python_version(),
        "platform": host.platform(),
        "versions": {name: versions.installed_version(name)
                     for name in ("vllm", "torch", "torch-npu", "transformers", "vllm-ascend")},
        "ascend": {"cann": toolchain.cann_version(), "nnal": toolchain.nnal(),
                   "driver": toolchain.driver_version(), "soc": toolchain.soc()},
        "settings": settings(),
        "doctor": doctor.report(),
        "verify_record": {"path": str(record), "record": _record(record)},
    }))
