"""The hardware acceptance kit behind ``ascend-patch verify``: tiny local models, CPU oracles,
the checks per NPU path and the evidence record they produce.

The engine tests build their models, oracles and engines from the same modules, so what CI
proves in emulation is what a user's NPU runs.

Docs: docs/hardware-kit.md, "Hardware acceptance kit: `ascend-patch verify`".
"""
