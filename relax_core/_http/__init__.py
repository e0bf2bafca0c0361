"""The private HTTP data path under the client and the gateways (not for plugins)."""
