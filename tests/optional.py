"""Optional components (chromium, vLLM, llama.cpp): a test that needs one skips where it is not
installed, except in CI (the CI environment variable set), where .ci/run installs every one of
them, so a missing one is a broken install and fails loudly instead of hiding behind a skip."""

import os

import pytest

CI_ENV = "CI"


def in_ci() -> bool:
    return os.environ.get(CI_ENV, "").strip().lower() not in ("", "0", "false", "no")


def require(present: bool, what: str, install: str) -> None:
    """Skip (locally) or fail (in CI) unless `present`; `what` names the component, `install`
    says how to get it."""
    if present:
        return
    if in_ci():
        pytest.fail(f"{what} is missing in CI ({CI_ENV} is set): {install}", pytrace=False)
    pytest.skip(f"{what} is not installed here ({install})")
