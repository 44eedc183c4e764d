"""Fixtures of the tests that install refengine: one wheel of this checkout for the session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.packaging.installs import copy_checkout, pip


@pytest.fixture(scope="session")
def refengine_wheel(tmp_path_factory) -> Path:
    """A wheel of this checkout, as ``pip install .`` builds it, built once for every test
    that installs refengine. It is built from a copy of the checkout's files (tracked and
    untracked-but-not-ignored, as a fresh clone would have them), so a stale ``build/``
    cannot leak into it."""
    tmp = tmp_path_factory.mktemp("wheel")
    copy_checkout(tmp / "src")
    pip("wheel", str(tmp / "src"), "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp / "dist"))
    (path,) = (tmp / "dist").glob("refengine-*.whl")
    return path
