"""The prefill worker: the generic worker (services.worker) with --role prefill."""
