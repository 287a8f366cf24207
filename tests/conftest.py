"""Shared test setup: ``tests/`` is on ``sys.path`` (pytest's rootdir conftest), so test modules in any
sub-folder import the test-only builders with ``import tiny_models``."""
