"""`ctxcache eval`: RULER-style tasks (`tasks`), the harness that runs a config through the service's
prefill/store/decode path (`harness`), and its outputs (`report`: JSON, markdown, PNG plots)."""
