"""The gateway: pdserve's public API (validation, tokenization, request life, usage)."""
