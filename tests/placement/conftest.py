"""Fixtures of the placement tests: a plugin manager with the shipped role records."""

from tests.support.roles import roles_plugin_manager

__all__ = ["roles_plugin_manager"]
