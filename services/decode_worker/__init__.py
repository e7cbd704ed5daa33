"""The decode worker: the generic worker (services.worker) with --role decode."""
