"""Tests here run against the real service: its fixtures load only for them (see tests/conftest.py)."""

from __future__ import annotations

import pytest

from tests.conftest import register_service_fixtures


def pytest_configure(config: pytest.Config) -> None:
    register_service_fixtures(config)
