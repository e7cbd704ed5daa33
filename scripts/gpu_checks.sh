#!/usr/bin/env bash
# GPU checks, for a machine with CUDA (CI has none): the CUDA tests, then the benchmarks with
# --device cuda. Results go to their own files (*-cuda*.json) so CPU figures are never mixed in.
#   scripts/gpu_checks.sh [tests|engine|spec|goodput|big|serving|stack|window|all]   PYTHON=... RESULTS_DIR=... GPU_TAG=...
# `all` is tests + engine + spec (a few minutes); `goodput` is a reduced chat sweep of three serving
# configurations on the GPU (about 6 minutes on an H200), run on its own. A GPU serves chat at
# 10-30 req/s, so the sweep starts at 2x the one-at-a-time rate and triples.
# `big` (issue 31): a Llama-3-8B shape with random weights (`--model random:llama-8b`, built on
# the GPU, nothing downloaded): decode attention in place vs gathered, then bench-engine with the
# decode step vs its floor at 1/8/16/64 sequences, pdserve vs HF padded / generate_batch and vs
# its own torch-only path. `serving`: that model through `pdserve up` over HTTP, unified and
# disaggregated, one request at a time and 64 at once. `stack` (issue 27, item 6): that model in
# three stacks one after another (disaggregated over NIXL, over the gRPC push, unified; two
# workers share the GPU in the first two): KV handoff / prefill time and TTFT disaggregated /
# unified at 512 and 2,048 prompt tokens, against the targets (5 %, 1.1x at 2,048); about 3-4
# minutes on an H200, mostly the three starts. `window`: chosen parts of the above, each time-
# boxed, for a short lease (WINDOW_PARTS, see below). Result files carry GPU_TAG (default: the
# GPU's name, e.g. h200).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RES=${RESULTS_DIR:-benchmarks/results}
what=${1:-all}
mkdir -p "$RES"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__, torch.cuda.get_device_name(0))'
rc=0
TAG=${GPU_TAG:-$($PY -c 'import re, torch; print(re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower().replace("nvidia", "")).strip("-"))')}
if [[ $what == tests || $what == all ]]; then
  # every test marked gpu (they skip without CUDA, so on a GPU machine none may skip)
  # -v and a per-test limit: a GPU window is short, so a hanging test must not hide the others,
  # and `timeout -s INT` around this script still gets pytest's summary of the failures so far
  $PY -m pytest -v -ra --tb=short --durations=15 -p no:cacheprovider --continue-on-collection-errors \
    --timeout "${GPU_TEST_TIMEOUT_S:-120}" -m gpu tests || rc=1
fi
if [[ $what == engine || $what == all ]]; then
  $PY -m benchmarks.bench_engine --device cuda --dtype bfloat16 \
    --output "$RES/engine-cuda-$TAG.json" || rc=1
fi
if [[ $what == spec || $what == all ]]; then
  # n-gram speculation on CUDA: its verify steps (k + 1 rows) replay as CUDA graphs; next to a
  # ~3.5 ms step the host's proposal time matters, so it is measured on this host too
  $PY -m benchmarks.ngram_proposer --out "$RES/ngram-proposer-cuda-host.json" || rc=1
  $PY -m benchmarks.bench_spec --device cuda --max-tokens 96 --num-speculative-tokens 5 --repeat 2 \
    --output "$RES/spec-cuda-$TAG.json" || rc=1
fi
if [[ $what == goodput ]]; then
  $PY -m benchmarks.bench_goodput --device cuda --workloads chat \
    --configs disaggregated,unified_dp2,conditional_unified \
    --quiet-requests 4 --start-factor 2 --growth 3 --max-points 4 --duration-s 15 \
    --min-requests 24 --max-requests 80 --max-send-s 20 --request-timeout-s 60 \
    --note "GPU: reduced chat sweep (scripts/gpu_checks.sh goodput)" \
    --out "$RES/goodput-cuda-$TAG.json" || rc=1
fi
if [[ $what == big ]]; then
  $PY -m benchmarks.cuda_attention --out "$RES/cuda-attention-$TAG.json" || rc=1
  $PY -m benchmarks.bench_engine --device cuda --dtype bfloat16 --model random:llama-8b \
    --contenders hf_padded,hf_continuous,pdserve,pdserve_torch --num-requests 32 \
    --kv-cache-tokens 40960 --no-prefix-run --floor-batches 1,8,16,64 --child-timeout-s 240 \
    --output "$RES/engine-cuda-llama-8b-$TAG.json" || rc=1
fi
if [[ $what == serving ]]; then
  $PY -m benchmarks.bench_serving --model random:llama-8b --device cuda --dtype bfloat16 \
    --out "$RES/serving-llama-8b-$TAG.json" || rc=1
fi
if [[ $what == window ]]; then
  # One short lease: the parts named in WINDOW_PARTS, in that order (default `stack serving
  # probe tests`):
  #   stack    the NIXL READ alone between two processes with the worker's UCX settings and
  #            without (nixl_probe, T_NIXL, UCX's protocol choice in its log: at b9f36ae "software
  #            emulation | tcp/lo", 0.43 GiB/s), and the same blocks written the other way (a
  #            WRITE, UCX's PUT: the alternative if the GET stays slow), then bench-stack at 2,048 tokens over both
  #            transports (issue 27's figures; at b9f36ae the handoff took 583 ms over NIXL);
  #   probe    the attention block-size sweep (alone: `attention`), and the step profile (alone:
  #            `profile`) at 1/8/64 sequences over
  #            32- and 16-token blocks (each against its floor) and of mixed steps (60
  #            decoding + a 2,048-token prompt chunk, the chunk alone, 4 fresh prompts of
  #            512 as a burst's step, alone and with 8 sequences decoding: at e5dd904 64 requests at once had TTFT p50 1,757 ms, as
  #            if such steps took ~4x a 2,048-token prefill, and the requests decoding meanwhile
  #            wait through them);
  #   serving  the unified stack with two gateways, one request at a time and 64 at once, with
  #            each service's CPU per token;
  #   tests    the CUDA tests on 4 processes, each failure's report written as it happens
  #            (gpu-test-failures-<gpu>.txt: a limit may interrupt pytest before its summary);
  #   engine   bench-engine on the 8B shape against HF's padded batch, steps vs floor as served;
  #   disagg   `pdserve up` disaggregated on the one GPU as up starts it (the decode worker with
  #            graphs, the prefill worker without) and with no graphs in either (`+eager`);
  #   fp8      bench-engine on the 8B shape, bf16 against --quantization fp8 (one run);
  #   fp8-70b  a 70B shape in FP8 on the one GPU: decode steps against their floor;
  #   offload  the host KV tier (--kv-offload-tokens) against a pool hit and a recompute;
  #   lora     LoRA adapters' cost: decode TPOT base / one adapter / mixed, prefill TTFT.
  # Each part has its own limit (T_<PART> seconds; SIGINT, so pytest and the benchmarks still
  # write what they have), so a slow one never takes the later ones' time. A 15-minute lease
  # (one call at most 600 s, a start ~35 s; the machine goes back after ~30 s idle, so the next
  # call must follow at once) fits two calls: `stack serving profile tests` (~440 s at b9f36ae:
  # stack 188, serving 66, profile 63, tests 112) and `engine disagg` (~300 s: 119 + 177).
  # NIXL comes from .gpu/nixl.tar.xz (scripts/nixl_bundle.sh) unpacked on PYTHONPATH.
  for part in ${WINDOW_PARTS:-stack serving probe tests}; do
    echo "== window part: $part ($(date +%T))"
    case $part in
      tests)
        timeout -s INT "${T_TESTS:-150}" $PY -m pytest -v -ra --tb=short --durations=15 \
          -p no:cacheprovider -n 4 --timeout 100 -m gpu \
          --failure-log "$RES/gpu-test-failures-$TAG.txt" tests || rc=1 ;;
      stack)
        # the READ alone first: two processes, per progress mode, UCX's protocol choice logged
        # with the worker's UCX settings (GET over CUDA IPC on) and without, for the A/B
        UCX_PROTO_INFO=y timeout -s INT "${T_NIXL:-60}" $PY -m benchmarks.nixl_probe --device cuda \
          --modes poll --ucx worker as-is --shapes run --ops READ WRITE IPC --out "$RES/nixl-probe-$TAG.json" > "$RES/nixl-probe-$TAG.log" 2>&1 || rc=1
        timeout -s INT 30 $PY -m benchmarks.nixl_probe --device cuda --modes poll --shapes scattered \
          --threads main --repeat 2 --out "$RES/nixl-probe-scattered-$TAG.json" >> "$RES/nixl-probe-$TAG.log" 2>&1 || rc=1
        grep "^{" "$RES/nixl-probe-$TAG.log"
        timeout -s INT "${T_STACK:-240}" $PY -m benchmarks.bench_stack --device cuda --dtype bfloat16 \
          --model random:llama-8b --lengths 2048 --reps 2 --ready-timeout-s 150 \
          --out "$RES/stack-cuda-llama-8b-$TAG.json" || rc=1 ;;
      serving)
        timeout -s INT "${T_SERVING:-95}" $PY -m benchmarks.bench_serving --model random:llama-8b \
          --device cuda --dtype bfloat16 --configs unified+2gw --sequential 4 --burst 64 \
          --out "$RES/serving-llama-8b-$TAG.json" || rc=1 ;;
      disagg)
        timeout -s INT "${T_DISAGG:-170}" $PY -m benchmarks.bench_serving --model random:llama-8b \
          --device cuda --dtype bfloat16 --configs disaggregated,disaggregated+eager --sequential 2 \
          --burst 64 --out "$RES/serving-disagg-llama-8b-$TAG.json" || rc=1 ;;
      engine)
        timeout -s INT "${T_ENGINE:-200}" $PY -m benchmarks.bench_engine --device cuda --dtype bfloat16 \
          --model random:llama-8b --contenders hf_padded,pdserve --num-requests 32 \
          --kv-cache-tokens 40960 --no-prefix-run --floor-batches 1,8,16,64 --child-timeout-s 150 \
          --output "$RES/engine-cuda-llama-8b-$TAG.json" || rc=1 ;;
      fp8)
        # FP8 weights (--quantization fp8) against bf16 on the 8B shape, in one run: tok/s and
        # the decode steps against their floors (FP8's floor reads half the weight bytes)
        timeout -s INT "${T_FP8:-200}" $PY -m benchmarks.bench_engine --device cuda --dtype bfloat16 \
          --model random:llama-8b --contenders pdserve,pdserve_fp8 --num-requests 32 \
          --kv-cache-tokens 40960 --no-prefix-run --no-floor-run --child-timeout-s 150 \
          --output "$RES/engine-fp8-llama-8b-$TAG.json" || rc=1 ;;
      fp8-70b)
        # a Llama-3-70B shape on the one GPU, possible only with FP8 weights (68 GB of products;
        # 139 GB in bf16): decode steps against their floor at 1/8/64 sequences, then the engine
        timeout -s INT "${T_FP8_70B:-240}" $PY -m benchmarks.cuda_step_profile --model random:llama-70b \
          --quantization fp8 --seqs 1 8 64 --paths fused --block-sizes 32 \
          --out "$RES/cuda-step-profile-fp8-llama-70b-$TAG.json" || rc=1 ;;
      offload)
        # the prefix cache's host tier: a revisited 2,048-token prompt from the pool, copied
        # back from pinned host memory, recomputed (one 8B engine per way)
        timeout -s INT "${T_OFFLOAD:-150}" $PY -m benchmarks.kv_offload --device cuda --dtype bfloat16 \
          --model random:llama-8b --prompt-tokens 2048 --block-size 32 --repeats 2 \
          --out "$RES/kv-offload-llama-8b-$TAG.json" || rc=1 ;;
      lora)
        # what serving through LoRA adapters costs on the 8B shape (4 random rank-16 adapters on
        # every projection): adapter steps run eagerly, without graphs or fused kernels
        timeout -s INT "${T_LORA:-150}" $PY -m benchmarks.lora --device cuda --dtype bfloat16 \
          --model random:llama-8b --batch 16 --new-tokens 32 --prompt-tokens 2048 --repeats 2 \
          --out "$RES/lora-llama-8b-$TAG.json" || rc=1 ;;
      probe|attention|profile)
        if [[ $part != profile ]]; then
        timeout -s INT "${T_PROBE:-60}" $PY -m benchmarks.cuda_attention --batches 1 8 64 \
          --contexts 512 2048 --block-sizes 32 64 128 --repeat 10 \
          --out "$RES/cuda-attention-$TAG.json" || rc=1
        fi
        [[ $part == attention ]] || timeout -s INT "${T_PROFILE:-120}" $PY -m benchmarks.cuda_step_profile --seqs 1 8 64 \
          --paths fused --block-sizes 32 16 --mixed 60:2048 0:2048 0:4x512 8:4x512 \
          --out "$RES/cuda-step-profile-$TAG.json" || rc=1 ;;
      *) echo "unknown window part: $part"; rc=1 ;;
    esac
  done
fi
if [[ $what == stack ]]; then
  $PY -m benchmarks.bench_stack --device cuda --dtype bfloat16 --model random:llama-8b \
    --lengths 512,2048 --reps 2 --ready-timeout-s 300 \
    --out "$RES/stack-cuda-llama-8b-$TAG.json" || rc=1
fi
exit $rc
