#!/usr/bin/env bash
# Every GPU check of this repository, for one call on a GPU machine, each step capped in time
# and logged under $OUT (or ./gpu-logs). User-facing steps:
#   tests           the GPU test files (TEST_WORKERS=n: over n pytest-xdist processes)
#   picks           the compile-time pick test, alone (it saturates every CPU core)
#   gemm            kernel benchmark (bench_gemm.py; writes $OUT/gemm.md)
#   autotune        cold and warm tuning benchmark
#   decode          decode benchmark (DECODE_ROUNDS: timed generations per method, default 3;
#                   writes $OUT/decode.md)
#   attention       decode attention against SDPA
#   defaults        default launches against tuned ones (bench_defaults.py; SHAPES, DEFAULTS_INCLUDE:
#                   earlier runs' JSON files for the table; writes $OUT/defaults.json and .md)
#   eager           eager per-call host cost and eager decoding (bench_eager.py; writes $OUT/eager.md)
#   hf              Hugging Face generate benchmark (bench_hf.py; HF_METHODS, HF_BATCHES, HF_LAYERS,
#                   HF_INCLUDE: earlier runs' JSON files for the table; writes $OUT/hf.json and
#                   $OUT/hf.md); needs transformers (.whl from device-wheels.sh --hf)
#   tp              tensor-parallel decode (bench_tp.py) at TP = 1, then TP = $TP_RANKS (default
#                   2) under torchrun: needs that many GPUs; writes $OUT/tp1.json and tp$TP_RANKS.json
# Steps that run the performance instruments of tools/perf/ (see its README):
#   sweep           config sweep of SWEEP_FAMILY (SWEEP_SPLITS, SWEEP_TILES) once per source
#                   tree in SWEEP_TREES (folders holding coalesced_int4/ and tools/perf/)
#   ab              in-process A/B of the GEMMs of source trees (ab_trees.py): AB_TREES="BASE
#                   VARIANT..." (folders holding coalesced_int4/), AB_CASES (NxKxM,...), AB_ROUNDS
#   profile         Nsight Compute counters of tuned launches (PROFILE_TILE, PROFILE_SPLIT: one
#                   W4A16 config instead), with per-SASS-line stall samples (stall_lines.py)
#   l2              L2 -> SM read bandwidth (l2_bandwidth.py)
#   reduce          the split-K reduction alone at every width (bench_reduce.py; REDUCE_NS,
#                   REDUCE_MS, REDUCE_SPLITS)
#   decode-profile  a compiled decode step's time per kernel kind
# Default: tests then gemm.
#   benchmarks/gpu_checks.sh [tests] [picks] [gemm] [autotune] [decode] [attention] [defaults] [eager] [hf] [tp] [sweep] [ab] [profile] [l2] [reduce] [decode-profile]
set -u
out=${OUT:-gpu-logs}
mkdir -p "$out"
if [ -d .whl ]; then  # wheels the GPU image lacks (torchao, gemlite), downloaded into .whl/ with pip download
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD} TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1 PYTHONUNBUFFERED=1
# Compiled kernels survive from one call to the next (each call is a fresh machine): a previous
# call's $OUT/triton-cache.tgz, copied into .gpu-cache/ (git-ignored) and carried, is unpacked
# here, and this call's cache is packed into $OUT for the next one.
export TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
if [ -f .gpu-cache/triton-cache.tgz ]; then tar xzf .gpu-cache/triton-cache.tgz -C "$TRITON_CACHE_DIR"; fi
steps=${*:-tests gemm}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv > "$out/gpu.txt" 2>&1
for step in $steps; do
  case $step in
    tests)
      # -v names each test as it ends, so a run stopped by the cap still says which finished.
      timeout "${TESTS_S:-420}" python -m pytest -v -rfs -p no:cacheprovider --durations=15 \
        ${TEST_WORKERS:+-n $TEST_WORKERS} ${TEST_FILES:-tests/gpu/test_gpu.py tests/gpu/test_compiled_gpu.py tests/gpu/test_autotune_gpu.py tests/gpu/test_hf_gpu.py tests/gpu/test_tensor_parallel_gpu.py \
        tests/kernels/test_decode_attention.py tests/kernels/test_int4_gemm_numerics.py tests/kernels/test_carveout.py} \
        > "$out/tests.log" 2>&1
      grep -E "passed|failed|FAILED|ERROR|SKIPPED" "$out/tests.log" | cut -c1-300 | tail -25 ;;
    picks)
      timeout "${PICKS_S:-240}" python -m pytest -q -rf -s -p no:cacheprovider tests/gpu/test_autotune_picks_gpu.py \
        > "$out/picks.log" 2>&1
      grep -E "passed|failed|FAILED|ERROR|regret" "$out/picks.log" | tail -10 ;;
    gemm)
      timeout "${GEMM_S:-240}" python benchmarks/bench_gemm.py --shapes "${SHAPES:-4096x4096,14336x4096,4096x14336,128256x4096}" \
        --ms "${MS:-1,4,16,64}" --methods "${METHODS:-ours,bf16,tinygemm}" --json "$out/gemm.json" --markdown "$out/gemm.md" \
        > "$out/gemm.log" 2>&1
      grep -E "^\||^#" "$out/gemm.log" | tail -40 ;;
    sweep)
      for tree in ${SWEEP_TREES:-.}; do
        tree=$(cd "$tree" && pwd); label=$(basename "$tree"); log=$out/sweep-${SWEEP_FAMILY:-w4a16}-$label
        # The tree's package first on the path and its own sweep script where it has one (its
        # grid names its kernels' parameters); its own empty pick cache, so that no pick of
        # another tree or of an earlier call on this machine is restored.
        sweep=$tree/tools/perf/sweep_configs.py; [ -f "$sweep" ] || sweep=tools/perf/sweep_configs.py
        COALESCED_INT4_CACHE_DIR=$(mktemp -d) PYTHONPATH=$tree:$PYTHONPATH timeout "${SWEEP_S:-150}" \
          python "$sweep" --family "${SWEEP_FAMILY:-w4a16}" --label "$label" \
          --shapes "${SHAPES:-8448x6656,4096x4096,14336x4096,256x6656}" --ms "${MS:-8,16,64}" \
          ${SWEEP_SPLITS:+--splits $SWEEP_SPLITS} ${SWEEP_TILES:+--tiles $SWEEP_TILES} --json "$log.json" > "$log.log" 2>&1
        grep -E "^\||^#" "$log.log" | cut -c1-440 | tail -16
      done ;;
    ab)
      # Its own empty pick cache: the baseline tunes every case afresh rather than restoring a
      # pick made for other code.
      COALESCED_INT4_CACHE_DIR=$(mktemp -d) timeout "${AB_S:-300}" python tools/perf/ab_trees.py ${AB_TREES:?AB_TREES=\"BASE VARIANT...\"} \
        ${AB_CASES:+--cases $AB_CASES} ${AB_ROUNDS:+--rounds $AB_ROUNDS} --json "$out/ab.json" > "$out/ab.log" 2>&1
      grep -E "^\||^#|Error" "$out/ab.log" | cut -c1-300 ;;
    profile)
      ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      # Tuned first without ncu (timings under ncu are not the real ones) into a fresh pick
      # cache, which the profiled run then restores instead of timing.
      picks=$(mktemp -d)
      # PROFILE_TILE / PROFILE_SPLIT: one W4A16 config at one split instead of the tuned picks.
      profile_args=(--shapes "${PROFILE_SHAPES:-8448x6656}" --ms "${MS:-1,4,16,64}"
                    ${PROFILE_TILE:+--tile $PROFILE_TILE --split ${PROFILE_SPLIT:-1}})
      COALESCED_INT4_CACHE_DIR=$picks timeout "${PROFILE_S:-240}" python tools/perf/profile_gemm.py \
        "${profile_args[@]}" > "$out/profile-picks.log" 2>&1
      # The full set, per-line stall samples (SourceCounters) included; the report is read
      # back as the details page and as per-SASS-line samples (profile-sass.csv), then dropped.
      COALESCED_INT4_CACHE_DIR=$picks timeout "${PROFILE_S:-240}" "$ncu" --clock-control none --nvtx \
        --nvtx-include "profile/" --set full --import-source no -o "$out/profile" \
        python tools/perf/profile_gemm.py "${profile_args[@]}" > "$out/profile.log" 2>&1
      "$ncu" -i "$out/profile.ncu-rep" --page details >> "$out/profile.log" 2>&1
      "$ncu" -i "$out/profile.ncu-rep" --page source --print-source sass --csv > "$out/profile-sass.csv" 2>&1
      rm -f "$out/profile.ncu-rep"
      grep -E "^# profile|==ERROR==|_kernel|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|No Eligible|Stall" \
        "$out/profile.log" | head -80
      python tools/perf/stall_lines.py "$out/profile-sass.csv" --top 12 | cut -c1-160 ;;
    l2)
      timeout "${L2_S:-120}" python tools/perf/l2_bandwidth.py > "$out/l2.log" 2>&1
      grep -E "^\||^#|Error" "$out/l2.log" ;;
    reduce)
      timeout "${REDUCE_S:-120}" python tools/perf/bench_reduce.py ${REDUCE_NS:+--ns $REDUCE_NS} \
        ${REDUCE_MS:+--ms $REDUCE_MS} ${REDUCE_SPLITS:+--splits $REDUCE_SPLITS} > "$out/reduce.log" 2>&1
      grep -E "^\||^#|Error" "$out/reduce.log" ;;
    autotune)
      timeout "${AUTOTUNE_S:-420}" python benchmarks/bench_autotune.py ${AUTOTUNE_BUCKETS:+--buckets $AUTOTUNE_BUCKETS} --json "$out/autotune.json" \
        > "$out/autotune.log" 2>&1
      grep -E "^\||^#" "$out/autotune.log" | tail -10 ;;
    decode-profile)
      timeout "${DECODE_PROFILE_S:-300}" python tools/perf/profile_decode.py --methods "${DECODE_METHODS:-ours,bf16}" \
        --batch "${BATCH:-1}" > "$out/decode-profile.log" 2>&1
      grep -E "^\||^#|failed|Error" "$out/decode-profile.log" | tail -60 ;;
    attention)
      timeout "${ATTENTION_S:-240}" python benchmarks/bench_attention.py > "$out/attention.log" 2>&1
      grep -E "^\||^#|Error" "$out/attention.log" | tail -30 ;;
    defaults)
      timeout "${DEFAULTS_S:-400}" python benchmarks/bench_defaults.py ${SHAPES:+--shapes $SHAPES} \
        ${DEFAULTS_INCLUDE:+--include-json $DEFAULTS_INCLUDE} \
        --json "$out/defaults.json" --markdown "$out/defaults.md" > "$out/defaults.log" 2>&1
      grep -E "^\||^#|Worst|Error" "$out/defaults.log" | tail -40 ;;
    eager)
      timeout "${EAGER_S:-240}" python benchmarks/bench_eager.py --markdown "$out/eager.md" > "$out/eager.log" 2>&1
      grep -E "^\||^#|Error" "$out/eager.log" | tail -20 ;;
    hf)
      timeout "${HF_S:-540}" python benchmarks/bench_hf.py --methods "${HF_METHODS:-bf16,ours,torchao}" \
        --batches "${HF_BATCHES:-1,4,16}" --layers "${HF_LAYERS:-32}" ${HF_INCLUDE:+--include-json $HF_INCLUDE} \
        --json "$out/hf.json" --markdown "$out/hf.md" > "$out/hf.log" 2>&1
      grep -E "^\||^#|Error" "$out/hf.log" | tail -40 ;;
    tp)
      timeout "${TP_S:-500}" python benchmarks/bench_tp.py --json "$out/tp1.json" > "$out/tp.log" 2>&1
      timeout "${TP_S:-500}" torchrun --nproc-per-node "${TP_RANKS:-2}" benchmarks/bench_tp.py \
        --json "$out/tp${TP_RANKS:-2}.json" >> "$out/tp.log" 2>&1
      grep -E "^\||^#|Error" "$out/tp.log" | tail -20 ;;
    decode)
      timeout "${DECODE_S:-500}" python benchmarks/bench_decode.py --methods "${DECODE_METHODS:-bf16,ours,torchao}" \
        --batches "${BATCHES:-1,16}" ${DECODE_ROUNDS:+--rounds $DECODE_ROUNDS} --json "$out/decode.json" --markdown "$out/decode.md" \
        > "$out/decode.log" 2>&1
      grep -E "^\||^#|tok/s|failed|Error" "$out/decode.log" | tail -30 ;;
  esac
done
tar czf "$out/triton-cache.tgz" -C "$TRITON_CACHE_DIR" .
if [ "$(stat -c %s "$out/triton-cache.tgz")" -gt $((15 * 1024 * 1024)) ]; then
  echo "# Triton cache over 15 MiB: not returned"; rm "$out/triton-cache.tgz"
fi
