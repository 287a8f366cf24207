"""Registers the ``verl`` marker: tests that import verl 0.9.1 (run in .venv-verl, scripts/setup_verl.sh).
Outside that environment they skip, unless ``NCGRPO_REQUIRE_VERL=1`` (what .ci/run sets for its verl
step), where a missing verl is an import error, so a broken environment cannot pass as skipped tests."""

from __future__ import annotations


def pytest_configure(config):
    config.addinivalue_line("markers", "verl: needs verl 0.9.1 (run in .venv-verl: scripts/setup_verl.sh)")
