"""One module per tier backend, each holding both its compile path and its reader side (cachestore.api)."""
