"""Helpers shared by the core's tests: engine-protocol servers, gateways, managers, serve runs."""
