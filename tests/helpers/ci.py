"""The CI run's policies (``CI=true``; .ci/run sets it): every skip is one the run chose, and
Hypothesis draws the same examples every run. A pytest plugin (tests/conftest.py loads it).

A skip nobody chose passes silently: the suite goes green while a claim went unchecked (a
network test skipping because PyPI is down, a fixture skipping on a missing file). Under CI a
skip whose reason is not in :data:`CHOSEN_SKIPS` fails the test instead; outside CI it stays a
skip, so a laptop without network can still run the suite.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from tests.helpers.process import under_ci

CHOSEN_SKIPS = {
    # reason the test gives (a part of it) -> why the main run skips it on purpose
    "recurrent layers are served on vLLM 0.33 and later":
        "the platform refuses recurrent layers on earlier releases (docs/compatibility.md)",
    "the platform serves vLLM's MooncakeConnector from 0.33":
        "earlier releases' Mooncake connectors are refused at start-up (docs/distributed.md)",
    "is recorded as untested":
        "compat_matrix.yaml records no static probe for an untested release to compare with",
    "vLLM 0.31+'s kernel registry":
        "a vLLM before 0.31 (a pinned older release's environment) has no Triton kernel registry",
}


def unchosen_skip(reason: str) -> bool:
    return not any(chosen in reason for chosen in CHOSEN_SKIPS)


# Hypothesis: in CI each test draws the examples its own source seeds (derandomize), so a red run
# is reproduced by running the same test again, anywhere, with HYPOTHESIS_PROFILE=ci; elsewhere
# each run draws new ones, and a failure prints the blob that replays it (@reproduce_failure).
settings.register_profile("ci", derandomize=True, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if under_ci() else "dev"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.skipped and not hasattr(report, "wasxfail") and under_ci():
        reason = report.longrepr[2].removeprefix("Skipped: ")
        if unchosen_skip(reason):
            report.outcome = "failed"
            report.longrepr = (f"skipped under CI for a reason the run did not choose: {reason} "
                               "(tests/helpers/ci.py CHOSEN_SKIPS lists the chosen ones)")
    return report
