"""ctxcache service: HTTP API, workers, settings and CLI."""
