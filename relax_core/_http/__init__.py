"""The private HTTP data path under the client and the gateways (not for plugins).

``headers`` (the one hop-by-hop rule), ``request`` (what every request body is read for: JSON,
its minimum weight version), ``http1`` (the lean pooled HTTP/1.1 client),
``upstream`` (a prepared request, its answer, failure classification) and ``transport``
(pooled connections with that classification).
"""
