"""Speculative decoding: proposers (n-gram prompt lookup, a draft model: draft.py), verification of
a proposed run against the target's samples, the per-request and per-step back-off policy, and
per-rank acceptance stats.

A decoding sequence contributes its last token plus up to k proposals to the rank's packed forward
pass; the target samples every one of those positions (greedy: argmax; sampled: the request's
(seed, output index) noise), and `accept_run` keeps the proposals up to the first mismatch plus the
target's own token there. Blocks only ever hold accepted tokens (scheduler.rollback).
"""
