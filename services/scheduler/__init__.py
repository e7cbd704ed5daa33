"""The scheduler service: picks prefill/decode workers, DP ranks and the serving mode per request."""
