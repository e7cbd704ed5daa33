"""The scheduler service: picks prefill/decode workers, DP ranks and the serving mode per request.

Contract with the gateway (scheduler.proto):
- ScheduleRequest: request_id (required), model ("" = the model most workers serve),
  prompt_tokens (count, after the chat template), prefix_block_hashes
  (`shared.block_hash.block_hashes(prompt_token_ids, block_size)` with the workers' block size),
  max_tokens, exclude_worker_ids (workers that failed an earlier attempt of this request).
- ScheduleResponse: mode; decode = {worker_id, address, dp_rank, capabilities} always; prefill
  only for DISAGGREGATED; model; max_model_len (0 = unknown). AGGREGATED and LOCAL_PREFILL both
  mean: Decode(local_prefill=true, dp_rank=decode.dp_rank) on the decode target. DISAGGREGATED:
  Decode(dp_rank=decode.dp_rank) first, then Prefill(dp_rank=prefill.dp_rank, kv_target =
  decode address + decode.dp_rank + ticket).
- UNAVAILABLE (message names what is missing) when no worker or no compatible pair can serve.
- Each decision reserves prompt_tokens on the chosen ranks until the worker's next load report.

Layout: policies.py (pure policy functions), reservations.py, prefix_index.py, router.py (the
decision, one lock), watcher.py (WatchLoads subscription), convert.py, servicer.py, server.py.
"""
