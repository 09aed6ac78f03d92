#!/usr/bin/env bash
# One call of the device tool (a GPU machine with torch/triton/transformers but none of our other
# dependencies): install the wheels carried in .whl/ (pydantic, faiss-cpu, zarr and their needs), run
# the GPU tests, then the GPU benchmarks. Everything it writes lands in $OUT. Idempotent.
#
#   device tool: run(command="bash benchmarks/device_run.sh tests decode before_after",
#                    carry=[".whl", ".old"])
#   stages: tests | kerneltests | decode | decodecold | decode512 | before_after | kernels | e2e32 | e2e128 |
#           e2e128rest | e2eprof | e2elayer | attntests | decodeab | psaab | latency | ncu | psasweep | pdlab | e2enow |
#           offload | psa32sweep | offloadfit | ivfsweep | ivfcpp | cslfsweep | ivfsel | ivfeager | ivfsample | ncusel | psaemit | psafuse | psastop | rtrip | rerankreg | rerank96 | e2ectkvr | ncuivf | verify | repro | e2eh200 | pushab | decode512h200 | s14ab | s14e2e | s14final | s14frame | s14tests | s14lfpse2e | s15ivf | s15ivf2 | s15dot | s15final | s15rerank | s16ahead | s16overlap | s16more | s16tests | s16early | s17ahead | s17pipe | s17offload | s17reads | s17fuse | s18pages | s18offprof | s18offab | s18numa | s18staged | s18prio | s18stprof | s18frame | s19tests | s19granule | s19cached | s19overlap | s19sweep | s19gen | s20quick | s20cache | s20more | s20staged | s20tests | s21prof | s21l2 | s21split | s21ahead | s21gemv | s21decode | s21wide | saapwide | s22saap | s22wide1 | s22wide8 | s22tests | s22ncu | s22repeat | s22split8 | s23ncu | s23knobs | s23splits | s23onetok | s23ab | s23dense | s23e2e |
#           s24attend | s24variants | s24regs | s24final | s24tests | s24stop | s25ncu | s25sel | s25final512 | s25knobs | s25pdl | s25attnpdl | s25saappdl | s25selsrc |
#           s26ab | s26mask | s26probe | s26selw | s26push | s26final | s27ab | s27kivf | s27tests | s27kivfknobs | s27kivfsel |
#           s28dot | s28kivf | s28knobs | s28exp | s28piv | s28tests | s28pf | s29tl | s29probe | s29keys | s29pdl | s29final | s29cb | s30scan | s30scan2 | s30tests | s30knobs | s30l2 | s30pdl |
#           s31split | s31split2 | s31split3 | s31rerank | s31prefetch | s32floors | s32probe | s32loads | s32order | s32pos | s32floors3 | s32final | s33rerank | s33all | s33all2 | s33all3 | s33fifo | s33lists | s34attn | s34attn2 | s34attend | s34attend2 | s34diag | s34pdl | s34w16 | s34final | s34check |
#           s35split | s35split2 | s35table | s35table512 | s35late | s35check | s36budget | s36budget2 | s36acq | s36pivots | s36e2e | s36final | s36tl | s36knobs | s36split |
#           s37crit | s37split | s37attend | s37attend2 | s37late | s37table | s37table512 | s37plan | s38blocks | s38plan | s38fused | s38parts | s38e2e | s39ids | s39more | s39pre | s39e2e | s39merge | s39final | s39knobs | s40knobs | s40pf | s40early | s40crit | s40len | s40merge | s40final | split_tma | s41table | s41table512 | s41repeat | s41mean
#   (default: tests decode before_after)
#   The device tool returns at most 8 files: past that, the run's JSON files come back as $OUT/json.tar.gz
#   (and everything as $OUT/all.tar.gz if that is not enough).
#   .old = the tree before the plan/run redesign (`git archive <commit> decoder indexer storage`), for
#   the before/after decode comparison.
set -uo pipefail
cd "$(dirname "$0")/.."
BUNDLE=${OUT:+1}  # $OUT set by the caller (the device tool sets it): pack what it would not return, at the end
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
stages=${*:-tests decode before_after}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
# old_new LABEL "METHODS" FILE...: the tree before a kernel change (each FILE from .old/<its name>_head.py, e.g.
# `git show <commit>:indexer/kernels/psa.py > .old/psa_head.py`) and this tree, alternating twice: gpu_decode at
# 32K and 128K, B = 1 and 8, with profiles (and the torch planners' agreement in the first run of this tree)
old_new() {
  local label=$1 methods=$2 i f
  shift 2
  rm -rf /tmp/old && mkdir -p /tmp/old && cp -r benchmarks decoder indexer storage tests /tmp/old/ || return 1
  for f in "$@"; do cp ".old/$(basename "$f" .py)_head.py" "/tmp/old/$f" || return 1; done
  for i in 1 2; do
    (cd /tmp/old && python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --backends triton \
      --methods $methods --out "$OUT/${label}_old$i" 2>&1 | grep "^| " | grep -v sdpa)
    python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --backends triton \
      --methods $methods $([ $i = 1 ] && echo --torch-plans) --out "$OUT/${label}_new$i" 2>&1 | grep "^| " | grep -v sdpa
  done
}
# tree_ab TAG TESTS K: this tree against the whole tree before (.old/tree, e.g. `git archive <commit> benchmarks
# decoder indexer storage tests | tar -x -C .old/tree`), alternating twice (session 40's A/B stages): the GPU tests of
# the files TESTS selected by -k K first; gpu_decode at 32K and 128K, B = 1 and 8, psa's budget rule over blocks of 128
# and 32 and its default rule; 512K over blocks of 128 in both trees; the timeline of this tree at 128K
tree_ab() {
  local tag=$1 tests=$2 k=$3 i P=psa@rule=budget,max_ratio=0.05
  python3 -m pytest -q -p no:cacheprovider -o addopts="" $tests -k "$k" 2>&1 | tee "$OUT/gpu_tests_$tag.log" | tail -2
  rm -rf /tmp/old && cp -r .old/tree /tmp/old || return 1
  for i in 1 2; do
    (cd /tmp/old && python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --backends triton \
      --methods $P,block_size=128 $P psa --out "$OUT/${tag}_old$i" 2>&1 | grep -E "Error|error")
    python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --backends triton --methods \
      $P,block_size=128 $P psa --out "$OUT/${tag}_new$i" 2>&1 | grep -E "Error|error"
  done 2>&1 | tee "$OUT/gpu_decode_$tag.log"
  (cd /tmp/old && python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --backends triton --methods \
    $P,block_size=128 --out "$OUT/${tag}512_old" 2>&1 | grep -E "Error|error")
  python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --backends triton --methods $P,block_size=128 \
    --out "$OUT/${tag}512" 2>&1 | tee "$OUT/gpu_decode_${tag}512.log" | grep -E "Error|error"
  python3 benchmarks/gpu_timeline.py --lengths 131072 --methods $P,block_size=128 --tag "_$tag" 2>&1 \
    | tee "$OUT/gpu_timeline_$tag.log" | grep -vE "^\|---"
}
# s31_split TAG (session 31, the s31split* stages): the IVF and stamps kernel tests on the GPU, then timelines at
# 128K of the shared selection against one program per selection (ctkvr alternating twice, kivf)
s31_split() {
  local tag=$1
  python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py tests/test_stamps.py 2>&1 \
    | tee "$OUT/gpu_tests_$tag.log" | tail -4
  python3 benchmarks/gpu_timeline.py --lengths 131072 --methods ctkvr ctkvr:select_parts=1 ctkvr \
    ctkvr:select_parts=1 kivf kivf:select_parts=1 --tag "_$tag" 2>&1 | tee "$OUT/gpu_timeline_$tag.log" \
    | grep -E "graph|_select|select plan|select push|gaps"
}
# s31_split_decode TAG: gpu_decode of the same at 128K (B = 1, 8; ctkvr and kivf) and 512K (B = 1, ctkvr)
s31_split_decode() {
  local tag=$1
  python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --backends triton --methods ctkvr \
    ctkvr:select_parts=1 ctkvr kivf kivf:select_parts=1 --out "$OUT/$tag" 2>&1 \
    | tee "$OUT/gpu_decode_$tag.log" | grep -E "sdpa|graph|Error|error"
  python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --backends triton --methods ctkvr \
    ctkvr:select_parts=1 ctkvr --out "$OUT/${tag}_512" 2>&1 | tee -a "$OUT/gpu_decode_$tag.log" \
    | grep -E "sdpa|graph|Error|error"
}
# s32_old FILE K TESTFILE TAG (session 32, the A/B stages): the GPU tests of tests/TESTFILE (-k K unless empty) into
# gpu_tests_TAG.log, then /tmp/old = this tree with FILE replaced by .old/<FILE's name>_head.py
s32_old() {
  python3 -m pytest -q -p no:cacheprovider -o addopts="" "tests/$3" ${2:+-k "$2"} 2>&1 | tee "$OUT/gpu_tests_$4.log" \
    | tail -2
  rm -rf /tmp/old && mkdir -p /tmp/old && cp -r benchmarks decoder indexer storage tests /tmp/old/ \
    && cp ".old/$(basename "$1" .py)_head.py" "/tmp/old/$1"
}
# s32_ab TAG I "METHODS" "NEW DECODE ARGS" "OLD DECODE ARGS" PATTERN: the I-th pair of this tree against /tmp/old,
# a timeline at 128K of METHODS (ctkvr for the old tree) and gpu_decode at 128K (B = 1, 8), each in turn
s32_ab() {
  local tag=$1 i=$2
  python3 benchmarks/gpu_timeline.py --lengths 131072 --methods $3 --tag "_${tag}_new$i" 2>&1 \
    | tee -a "$OUT/gpu_timeline_$tag.log" | grep -E "$6"
  (cd /tmp/old && python3 benchmarks/gpu_timeline.py --lengths 131072 --methods ctkvr --tag "_${tag}_old$i" \
    --out "$OUT" 2>&1 | tee -a "$OUT/gpu_timeline_$tag.log" | grep -E "$6")
  python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 $4 --out "$OUT/${tag}_new$i" 2>&1 \
    | tee -a "$OUT/gpu_decode_$tag.log" | grep -E "graph|Error|error"
  (cd /tmp/old && python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 $5 --out "$OUT/${tag}_old$i" 2>&1 \
    | tee -a "$OUT/gpu_decode_$tag.log" | grep -E "graph|Error|error")
}
# s32_512 TAG "METHODS" NAME: gpu_decode at 512K, B = 1, of METHODS (in the current directory's tree)
s32_512() {
  python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --backends triton --methods $2 --out "$OUT/${1}_$3" \
    2>&1 | tee -a "$OUT/gpu_decode_$1.log" | grep -E "graph|Error|error"
}
# ivf_ab TAG "A B" K (sessions 33-34): the IVF kernel tests selected by -k K on the GPU, then the methods A and B
# alternating twice: gpu_decode at 128K (B = 1, 8) with profiles, at 512K (B = 1), and timelines at 128K
ivf_ab() {
  python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py -k "$3" 2>&1 \
    | tee "$OUT/gpu_tests_$1.log" | tail -2
  python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --backends triton --profile --methods $2 $2 \
    --out "$OUT/$1" 2>&1 | tee "$OUT/gpu_decode_$1.log" | grep -E "graph|Error|error|kernels,"
  s32_512 "$1" "$2 $2" 512
  python3 benchmarks/gpu_timeline.py --lengths 131072 --methods $2 --tag "_$1" 2>&1 \
    | tee "$OUT/gpu_timeline_$1.log" | grep -vE "^\|---"
}
for stage in $stages; do
  case $stage in
    tests)  # every GPU-marked test (~3 min on the H200). The kernel files' other tests, run on the GPU as well, took
      # past a call's 10 minutes in sessions 39 and 41, so they are their own stages (kerneltests, attntests)
      python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" \
        tests/test_gpu_decode.py tests/test_triton_attention.py tests/test_backends.py tests/test_pipeline.py \
        tests/test_csattn.py tests/test_saap_device.py tests/test_runner.py tests/test_kernels_*.py \
        2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;
    kerneltests)  # the kernel test files only, GPU and non-GPU tests alike
      python3 -m pytest -q -p no:cacheprovider -o addopts="" -x tests/test_kernels_*.py 2>&1 \
        | tee "$OUT/gpu_kernel_tests.log" | tail -30 ;;
    kernels)
      python3 benchmarks/gpu_select.py --sweep 2>&1 | tee "$OUT/gpu_select.log" | tail -25
      python3 benchmarks/gpu_saap_plan.py --sweep 2>&1 | tee "$OUT/gpu_saap_plan.log" | tail -25
      [ -f benchmarks/gpu_ivf.py ] && python3 benchmarks/gpu_ivf.py 2>&1 | tee "$OUT/gpu_ivf.log" | tail -25 ;;
    e2e32)
      python3 benchmarks/gpu_e2e.py --lengths 32768 --batches 1 8 2>&1 | tee "$OUT/gpu_e2e_32k.log" | tail -30 ;;
    e2e128)
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 8 --methods hf full ctkvr saap csattn 2>&1 \
        | tee "$OUT/gpu_e2e_128k.log" | tail -30 ;;
    e2e128rest)  # the methods and the offload rows the first 128K run left out
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 8 --methods full csattn psa lfps kivf ctkvr \
        --backends triton offload --offload-batches 8 --offload-methods csattn ctkvr --eager-tokens 0 --hf-tokens 0 --tokens 8 \
        --out "$OUT/e2e_rest" 2>&1 | tee "$OUT/gpu_e2e_128k_rest.log" | tail -40 ;;
    decode)
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --torch-plans --backends triton \
        2>&1 | tee "$OUT/gpu_decode.log" \
        | grep -v "^  \|^    " ;;
    decodecold)  # cold and warm L2 side by side (benchmarks/_gpu_timing.py), B = 1, with kernel profiles
      python3 benchmarks/gpu_decode.py --lengths 131072 32768 --batches 1 --l2 both --profile --backends triton \
        --methods streaming csattn ctkvr lfps psa saap --out "$OUT/cold" 2>&1 | tee "$OUT/gpu_decode_cold.log" \
        | grep -v "^  \|^    " ;;
    offload)  # the offload backends (context in mapped host memory): their GPU tests, then 128K B = 8 end to end
      python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" tests/test_gpu_decode.py tests/test_runner.py \
        tests/test_pipeline.py -k "offload or backends or tier" 2>&1 | tee "$OUT/gpu_tests_offload.log" | tail -15
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 8 --methods full csattn saap psa ctkvr \
        --backends triton offload offload_v --offload-batches 8 --offload-methods csattn saap psa ctkvr \
        --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 380 --out "$OUT/e2e_offload" 2>&1 \
        | tee "$OUT/gpu_e2e_offload.log" | grep "^|\|Error\|error" | tail -30 ;;
    e2eprof)  # where a token's time goes: the kernels of one replayed B = 1 step per method
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 8 --methods full psa saap csattn --profile \
        --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 500 --out "$OUT/e2e_prof" 2>&1 \
        | tee "$OUT/gpu_e2e_prof.log" | tail -30 ;;
    e2elayer)  # the fused layer ops (decoder/kernels/layer.py) on and off, same run; their tests first
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_layer_kernels.py 2>&1 | tail -3 \
        | tee "$OUT/gpu_layer_tests.log"
      python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" tests/test_runner.py 2>&1 | tail -3 \
        | tee -a "$OUT/gpu_layer_tests.log"
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 8 --methods full saap psa --layer-ab --profile \
        --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 420 --out "$OUT/e2e_layer" 2>&1 \
        | tee "$OUT/gpu_e2e_layer.log" | tail -16 ;;
    attntests)  # the attention kernels' tests on the GPU (real concurrency for the fused merge's tickets)
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_triton_attention.py 2>&1 | tail -4 \
        | tee "$OUT/gpu_attention_tests.log" ;;
    decodeab)  # KernelConfig variants of the attention kernels side by side, B = 1, with kernel profiles
      python3 benchmarks/gpu_decode.py --lengths 131072 32768 --batches 1 --profile --methods streaming psa saap csattn \
        --backends triton triton:fused_merge=0 triton:num_stages=1 triton:block_n=64 --out "$OUT/ab" 2>&1 \
        | tee "$OUT/gpu_decode_ab.log" | grep -v "^  \|^    " ;;
    psaab)  # psa's select with its keys in registers against the scratch path, same run; its kernel tests first
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_psa.py tests/test_kernels_ivf.py 2>&1 \
        | tail -3 | tee "$OUT/gpu_psa_tests.log"
      python3 benchmarks/gpu_decode.py --lengths 131072 32768 --batches 1 --profile --torch-plans --backends triton \
        --methods psa psa:regs_select=0 --out "$OUT/psaab" 2>&1 | tee "$OUT/gpu_decode_psaab.log" | grep -v "^  \|^    " ;;
    latency)  # the split kernel's fixed cost over its knobs (benchmarks/gpu_split_latency.py)
      { which ncu nsys; ls /usr/local/cuda/bin 2>/dev/null | head -30; } 2>&1 | tee "$OUT/tools.txt"
      python3 benchmarks/gpu_split_latency.py 2>&1 | tee "$OUT/gpu_split_latency.log" ;;
    ncu)  # Nsight Compute on one psa step at 128K, then a streaming step: where each kernel's time goes
      /usr/local/cuda/bin/ncu -k regex:"_(crit|select|sums|stop|split|merge)_kernel" --launch-count 7 \
        --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy \
        --section MemoryWorkloadAnalysis --section SchedulerStats \
        python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 --methods psa streaming --backends triton \
        --reps 2 --out "$OUT/ncu_run" > "$OUT/ncu_psa.txt" 2>&1; tail -5 "$OUT/ncu_psa.txt" ;;
    psasweep)  # psa's plan knobs (PsaConfig) one at a time, 128K, B = 1, kernel profiles
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 --profile --backends triton --methods psa \
        psa:select_warps=16 psa:select_warps=4 psa:tile_tokens=64 psa:tile_tokens=256 psa:sums_warps=8 \
        psa:stop_parts=32 psa:stop_warps=8 psa:block_b=128 psa:block_b=32 psa:crit_warps=8 psa:pos_block=512 \
        --out "$OUT/psasweep" 2>&1 | tee "$OUT/gpu_decode_psasweep.log" | grep -v "^  \|^    " ;;
    offloadfit)  # (H200) 128K, B = 8 on eight context copies: offload_v's rows, and whether dense / all-GPU fit
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 8 --methods full ctkvr psa --backends triton offload_v \
        --offload-batches 8 --offload-methods ctkvr --offload-contexts copies --fit-check --eager-tokens 0 \
        --hf-tokens 0 --tokens 8 --budget-s 480 --out "$OUT/e2e_fit" 2>&1 | tee "$OUT/gpu_e2e_fit.log" \
        | grep "^|\|rror\|fit" | tail -30 ;;
    ivfsweep)  # ctkvr's IvfConfig knobs (reasoned defaults, never swept on a GPU before), B = 1, with profiles
      python3 benchmarks/gpu_decode.py --lengths 131072 32768 --batches 1 --profile --backends triton \
        --methods ctkvr ctkvr:select_block=4096 ctkvr:select_block=8192 ctkvr:select_warps=4 ctkvr:select_warps=16 \
        ctkvr:block_u=128 ctkvr:chunks_per_prog=2 ctkvr:rerank_warps=8 ctkvr:block_c=128 --out "$OUT/ivf" 2>&1 \
        | tee "$OUT/gpu_decode_ivf_sweep.log" | grep -v "^  \|^    " ;;
    ivfcpp)  # the rerank's chunks per program, 2 (the default) against 1 and 4, with plan agreement; kernel tests first
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py 2>&1 | tail -2 \
        | tee "$OUT/gpu_ivf_tests.log"
      python3 benchmarks/gpu_decode.py --lengths 131072 32768 --batches 1 8 --profile --torch-plans --backends triton \
        --methods ctkvr ctkvr:chunks_per_prog=1 ctkvr:chunks_per_prog=4 kivf kivf:chunks_per_prog=1 --out "$OUT/ivfcpp" \
        2>&1 | tee "$OUT/gpu_decode_ivf_cpp.log" | grep -v "^  \|^    " ;;
    ivfsel)  # ctkvr's select (two programs per push row) and probe blocks of 32, a probe-warps A/B; kernel tests first
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py tests/test_kernels_psa.py 2>&1 \
        | tail -2 | tee "$OUT/gpu_ivf_sel_tests.log"
      python3 benchmarks/gpu_decode.py --lengths 131072 32768 --batches 1 8 --profile --torch-plans --backends triton \
        --methods ctkvr ctkvr:probe_warps=8 kivf --out "$OUT/ivfsel" 2>&1 \
        | tee "$OUT/gpu_decode_ivf_sel.log" | grep -v "^  \|^    "
      python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --backends triton --profile \
        --methods ctkvr ctkvr:probe_warps=8 saap --out "$OUT/ivfsel512" 2>&1 | tee "$OUT/gpu_decode_ivf_sel512.log" \
        | grep -v "^  \|^    " ;;
    ivfeager)  # ctkvr's rerank: K rows loaded before the dedup atomic answers (the default) against after
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py 2>&1 | tail -2 \
        | tee "$OUT/gpu_ivf_eager_tests.log"
      python3 benchmarks/gpu_decode.py --lengths 131072 32768 --batches 1 8 --profile --backends triton \
        --methods ctkvr ctkvr:eager_rows=0 --out "$OUT/ivfeager" 2>&1 | tee "$OUT/gpu_decode_ivf_eager.log" \
        | grep -v "^  \|^    "
      python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --backends triton \
        --methods ctkvr ctkvr:eager_rows=0 --out "$OUT/ivfeager512" 2>&1 | tee "$OUT/gpu_decode_ivf_eager512.log" \
        | grep -v "^  \|^    " ;;
    ivfsample)  # ctkvr's / kivf's select bracketed from a sample, its emit fused (the default) against the plain search
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py 2>&1 \
        | tail -2 | tee "$OUT/gpu_ivf_sample_tests.log"
      python3 benchmarks/gpu_decode.py --lengths 131072 32768 --batches 1 8 --profile --torch-plans --backends triton \
        --methods ctkvr ctkvr:sample_select=0 kivf kivf:sample_select=0 \
        --out "$OUT/ivfsample" 2>&1 | tee "$OUT/gpu_decode_ivf_sample.log" | grep -v "^  \|^    "
      python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --backends triton --profile \
        --methods ctkvr ctkvr:sample_select=0 --out "$OUT/ivfsample512" 2>&1 | tee "$OUT/gpu_decode_ivf_sample512.log" \
        | grep -v "^  \|^    " ;;
    ncusel)  # ctkvr at 128K: select warps 8 (the default) against 16, then Nsight Compute on its select and rerank
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --profile --backends triton \
        --methods ctkvr ctkvr:select_warps=16 ctkvr:select_block=1024 --out "$OUT/ncusel_ab" 2>&1 \
        | tee "$OUT/gpu_decode_ncusel_ab.log" | grep -v "^  \|^    "
      for k in select rerank; do
        /usr/local/cuda/bin/ncu -k regex:"_${k}_kernel" --launch-count 1 --section SpeedOfLight --section WarpStateStats \
          --section LaunchStats --section Occupancy --section SourceCounters --page details \
          python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 --methods ctkvr --backends triton --reps 2 \
          --out "$OUT/ncu_sel_run" > "$OUT/ncu_ctkvr_${k}.txt" 2>&1
        /usr/local/cuda/bin/ncu -k regex:"_${k}_kernel" --launch-count 1 --section SourceCounters --page source \
          --print-source cuda,sass --csv python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 --methods ctkvr \
          --backends triton --reps 2 --out "$OUT/ncu_sel_run" > "$OUT/ncu_ctkvr_${k}_source.csv" 2>&1
        grep -i "duration\|registers per\|achieved occ\|warp cycles per issued\|theoretical occ" "$OUT/ncu_ctkvr_${k}.txt" | head -12
        ls -la "$OUT/ncu_ctkvr_${k}_source.csv"; head -c 600 "$OUT/ncu_ctkvr_${k}_source.csv"
      done ;;
    psaemit)  # psa's select emit, one packed scan per tile, against the tree before it (.old/psa_head.py: `git show
      # <commit>:indexer/kernels/psa.py`), alternating old / new twice; psa kernel tests first
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_psa.py 2>&1 | tail -1 \
        | tee "$OUT/gpu_psa_emit_tests.log"
      old_new psaemit psa indexer/kernels/psa.py ;;
    psafuse)  # psa's stop run by the last sums program (the default) against its own launch, twice (in both orders);
      # the kernel test files first (ivf, psa, attention). Runs at commit 441f0f6 only: the change was rejected and
      # its knob `fuse_stop` removed with it
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_psa.py tests/test_kernels_ivf.py \
        tests/test_triton_attention.py 2>&1 | tail -2 | tee "$OUT/gpu_psa_fuse_tests.log"
      for i in 1 2; do
        python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --backends triton \
          --methods $([ "$i" = 1 ] && echo "psa psa:fuse_stop=0 --torch-plans" || echo "psa:fuse_stop=0 psa") \
          --out "$OUT/psafuse$i" 2>&1 \
          | grep "^| .*psa"
      done ;;
    psastop)  # psa's stop and select with their first loads issued up front against the tree before them
      # (.old/psa_head.py: `git show 0fdc0ad:indexer/kernels/psa.py`); psa kernel tests first
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_psa.py 2>&1 | tail -1 \
        | tee "$OUT/gpu_psa_stop_tests.log"
      old_new psastop psa indexer/kernels/psa.py ;;  # (the 14:12 UTC run also timed a knob since removed)
    rtrip)  # psa's sums and the attention's merge with their first loads issued with the count, against the
      # tree before (.old/{psa,attention}_head.py), alternating twice, psa and csattn; their kernel tests first
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_psa.py tests/test_triton_attention.py \
        2>&1 | tail -1 | tee "$OUT/gpu_rtrip_tests.log"
      old_new rtrip "psa csattn" indexer/kernels/psa.py decoder/kernels/attention.py ;;
    rerankreg)  # ctkvr's rerank under a register cap (4 or 5 programs per SM instead of 3) and at 3 chunks per
      # program, against the defaults, B = 1 and 8; then the GPU-marked tests
      python3 benchmarks/gpu_decode.py --lengths 131072 32768 --batches 1 8 --profile --backends triton \
        --methods ctkvr ctkvr:rerank_maxnreg=128 ctkvr:rerank_maxnreg=96 ctkvr:chunks_per_prog=3 ctkvr \
        --out "$OUT/rerankreg" 2>&1 | tee "$OUT/gpu_decode_rerankreg.log" | grep "^| .*ctkvr"
      python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" \
        tests/test_gpu_decode.py tests/test_triton_attention.py tests/test_backends.py tests/test_pipeline.py \
        tests/test_csattn.py tests/test_saap_device.py tests/test_runner.py tests/test_kernels_*.py \
        2>&1 | tee "$OUT/gpu_marked_tests.log" | tail -5 ;;
    rerank96)  # the rerank's register cap of 96 (the default) against none, ctkvr and kivf, twice in both
      # orders; the IVF kernel tests that run the rerank at its defaults first
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py \
        -k "fused_plan_equals_torch or duplicates or graph" 2>&1 | tail -1 | tee "$OUT/gpu_rerank96_tests.log"
      i=0
      for m in "ctkvr ctkvr:rerank_maxnreg=0 kivf kivf:rerank_maxnreg=0" "ctkvr:rerank_maxnreg=0 ctkvr kivf:rerank_maxnreg=0 kivf"; do
        i=$((i + 1))
        python3 benchmarks/gpu_decode.py --lengths 131072 32768 --batches 1 8 --profile --backends triton --methods $m \
          $([ $i = 1 ] && echo --torch-plans) --out "$OUT/rerank96_$i" 2>&1 | grep "^| .*\(ctkvr\|kivf\)"
      done ;;
    e2ectkvr)  # the runner at 128K after ctkvr's select change: dense, ctkvr and saap, B = 1 and 8
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 8 --methods full ctkvr saap \
        --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 450 --out "$OUT/e2ectkvr" 2>&1 \
        | tee "$OUT/gpu_e2e_ctkvr.log" | tail -16 ;;
    ncuivf)  # Nsight Compute on ctkvr's select kernel at 32K, B = 1
      for m in ctkvr; do
        /usr/local/cuda/bin/ncu -k regex:"_select_kernel" --launch-count 1 --section SpeedOfLight \
          --section WarpStateStats --section LaunchStats --section InstructionStats --section SourceCounters \
          --section MemoryWorkloadAnalysis python3 benchmarks/gpu_decode.py --lengths 32768 --batches 1 \
          --methods "$m" --backends triton --reps 2 --out "$OUT/ncu_ivf_run" > "$OUT/ncu_ivf_${m//[:=]/_}.txt" 2>&1
        grep -i "duration\|registers\|local\|stall\|executed ipc\|warp cycles\|spill" "$OUT/ncu_ivf_${m//[:=]/_}.txt" | head -40
      done ;;
    cslfsweep)  # csattn's and lfps's kernel knobs (csattn's never swept on a GPU before), B = 1, with profiles
      python3 benchmarks/gpu_decode.py --lengths 131072 32768 --batches 1 --profile --backends triton \
        --methods csattn csattn:block=512 csattn:block=2048 csattn:warps=8 csattn:warps=2 csattn:block_n=512 \
        csattn:block_n=2048 csattn:finalize_warps=8 lfps lfps:block=128 lfps:block=512 lfps:programs_per_sm=2 \
        lfps:programs_per_sm=8 lfps:num_warps=8 lfps:score_tiles=2 lfps:block_score=128 --out "$OUT/cslf" 2>&1 \
        | tee "$OUT/gpu_decode_cslf_sweep.log" | grep -v "^  \|^    " ;;
    psa32sweep)  # psa's plan knobs and the attention kernel's split knobs at 32K (the 128K sweep: psasweep)
      python3 benchmarks/gpu_decode.py --lengths 32768 --batches 1 --backends triton triton:programs_per_sm=1 \
        triton:programs_per_sm=4 --methods psa psa:select_warps=4 psa:stop_parts=8 psa:stop_parts=4 \
        psa:tile_tokens=64 psa:block_b=32 psa:score_block=512 psa:crit_warps=2 --out "$OUT/psa32" 2>&1 \
        | tee "$OUT/gpu_decode_psa32.log" | grep -v "^  \|^    " ;;
    pdlab)  # programmatic dependent launch on and off (psa's plan kernels and the attention kernels), same run
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_psa.py tests/test_triton_attention.py \
        2>&1 | tail -3 | tee "$OUT/gpu_pdl_tests.log"
      python3 benchmarks/gpu_decode.py --lengths 131072 32768 --batches 1 8 --profile --torch-plans --methods psa psa:pdl=0 \
        --backends triton triton:pdl=0 --out "$OUT/pdlab" 2>&1 | tee "$OUT/gpu_decode_pdlab.log" | grep -v "^  \|^    " ;;
    e2enow)  # the runner at 128K with the current kernels: dense against the two best methods, B = 1 and 8
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 8 --methods full psa saap --profile \
        --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 450 --out "$OUT/e2enow" 2>&1 \
        | tee "$OUT/gpu_e2e_now.log" | tail -16 ;;
    repro)  # session 13: plan rows in a canonical order (the radix select's compaction by published counts, CTkvr's
      # dedup by probe rank) against the tree before (.old/{select,ivf}_head.py), alternating twice, the four methods
      # they plan for; the GPU-marked tests first (the bitwise-reproducibility test among them)
      python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" \
        tests/test_gpu_decode.py tests/test_triton_attention.py tests/test_backends.py tests/test_pipeline.py \
        tests/test_csattn.py tests/test_saap_device.py tests/test_runner.py tests/test_kernels_*.py \
        2>&1 | tee "$OUT/gpu_marked_tests.log" | tail -6
      old_new repro "topk csattn lfps ctkvr" indexer/kernels/select.py indexer/kernels/ivf.py ;;
    e2eh200)  # session 13 (H200): the runner at 128K, dense against streaming (the frame alone: the floor of any
      # method on this attention kernel) and the three best methods, B = 1 and 8, kernel profiles of one B = 1 token
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 8 --methods full streaming psa ctkvr saap --profile \
        --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 430 --out "$OUT/e2eh200" 2>&1 \
        | tee "$OUT/gpu_e2e_h200.log" | tail -24 ;;
    pushab)  # session 13: CTkvr's FIFO push over KVH x chunks programs (a ticket for the counter) against one program
      # (.old/ivf_head.py), the runner at 128K, B = 1 and 8, old then new (a run prefills the 8B model at 128K: 42 s);
      # its GPU tests first
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py 2>&1 | tail -2 \
        | tee "$OUT/gpu_push_tests.log"
      python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" tests/test_runner.py tests/test_gpu_decode.py \
        -k "ctkvr or runner or graph_replay" 2>&1 | tail -2 | tee -a "$OUT/gpu_push_tests.log"
      rm -rf /tmp/old && mkdir -p /tmp/old && cp -r benchmarks decoder indexer storage tests /tmp/old/ \
        && cp .old/ivf_head.py /tmp/old/indexer/kernels/ivf.py || exit 1
      for i in 1; do
        (cd /tmp/old && python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 8 --methods full ctkvr --profile \
          --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 200 --out "$OUT/push_old$i" 2>&1 | grep "^| 131072")
        python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 8 --methods full ctkvr --profile \
          --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 200 --out "$OUT/push_new$i" 2>&1 | grep "^| 131072"
      done ;;
    decode512h200)  # session 13 (H200): the 512K row, one invocation per method (each keeps its rows if the call runs
      # out of time; each times SDPA full again in its own run)
      for m in ctkvr psa saap csattn streaming; do
        python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --backends triton --methods $m \
          --out "$OUT/512k_$m" 2>&1 | tee "$OUT/gpu_decode_512k_$m.log" | grep "^| 524288"
      done ;;
    verify)  # session 12: the GPU-marked tests of the tree, then every method's decode table (the `decode` stage)
      python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" \
        tests/test_gpu_decode.py tests/test_triton_attention.py tests/test_backends.py tests/test_pipeline.py \
        tests/test_csattn.py tests/test_saap_device.py tests/test_runner.py tests/test_kernels_*.py \
        2>&1 | tee "$OUT/gpu_marked_tests.log" | tail -4
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --torch-plans --backends triton \
        --out "$OUT/decode" 2>&1 | tee "$OUT/gpu_decode.log" | grep "^| " ;;
    s14ab)  # session 14: lfps's score kernel with the flags and softmax states folded in (2 launches less) against
      # the tree before (.old/lfps_head.py), alternating twice; psa capped at rho (max_ratio 0.05) next to the
      # benchmark's 10% in one run; the lfps GPU tests first
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_lfps.py 2>&1 | tail -2 \
        | tee "$OUT/gpu_lfps_tests.log"
      python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" tests/test_gpu_decode.py tests/test_runner.py \
        -k "lfps or reproducible" 2>&1 | tail -2 | tee -a "$OUT/gpu_lfps_tests.log"
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --backends triton \
        --methods psa psa@max_ratio=0.05 --torch-plans --out "$OUT/psacap" 2>&1 | grep "^| " | grep -v sdpa_slice
      old_new lfpsab "lfps" indexer/kernels/lfps.py ;;
    s14e2e)  # session 14: the runner at 128K with psa capped at rho (max_ratio 0.05) next to its 10% cap, dense and
      # streaming in the same run; then lfps's score-kernel knobs with the folded states (tiles per program, states
      # merged per step); the lfps kernel tests first
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_lfps.py 2>&1 | tail -2 \
        | tee "$OUT/gpu_lfps_tests.log"
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 8 --methods full streaming psa psa@max_ratio=0.05 \
        --profile --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 330 --out "$OUT/e2ecap" 2>&1 \
        | tee "$OUT/gpu_e2e_cap.log" | grep "^| 131072"
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --backends triton \
        --methods lfps lfps:score_tiles=4 lfps:score_tiles=4,block_states=256 --out "$OUT/lfpsknobs" 2>&1 \
        | grep "^| " | grep -v sdpa_slice ;;
    s14final)  # session 14, final tree: every GPU-marked test, then lfps's final defaults (4 score tiles per program,
      # states merged 256 per step) against the tree before the session (.old/lfps_head.py), alternating twice
      python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" \
        tests/test_gpu_decode.py tests/test_triton_attention.py tests/test_backends.py tests/test_pipeline.py \
        tests/test_csattn.py tests/test_saap_device.py tests/test_runner.py tests/test_kernels_*.py \
        2>&1 | tee "$OUT/gpu_marked_tests.log" | tail -4
      old_new lfpsfinal "lfps" indexer/kernels/lfps.py ;;
    s14frame)  # session 14: lfps's frame launch folded into another: into the candidates launch (this tree) or the
      # moments launch (.old/lfps_moments.py), against the tree before (.old/lfps_head.py), alternating twice; the
      # lfps kernel tests of both variants first
      rm -rf /tmp/old /tmp/mom && mkdir -p /tmp/old /tmp/mom || exit 1
      cp -r benchmarks decoder indexer storage tests /tmp/old/ && cp .old/lfps_head.py /tmp/old/indexer/kernels/lfps.py
      cp -r benchmarks decoder indexer storage tests /tmp/mom/ && cp .old/lfps_moments.py /tmp/mom/indexer/kernels/lfps.py
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_lfps.py 2>&1 | tail -1 \
        | tee "$OUT/gpu_lfps_frame_tests.log"
      (cd /tmp/mom && python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_lfps.py 2>&1 | tail -1) \
        | tee -a "$OUT/gpu_lfps_frame_tests.log"
      for i in 1 2; do
        for v in old mom; do
          (cd /tmp/$v && python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --backends triton \
            --methods lfps --out "$OUT/frame_$v$i" 2>&1 | grep "^| " | grep -v sdpa)
        done
        python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --backends triton \
          --methods lfps $([ $i = 1 ] && echo --torch-plans) --out "$OUT/frame_cand$i" 2>&1 | grep "^| " | grep -v sdpa
      done ;;
    s15ivf)  # session 15: the IVF probe with every head's centroid rows in one load and the rerank with the next
      # chunk's positions loaded ahead, against the tree before (.old/ivf_head.py), alternating twice (ctkvr and kivf,
      # 32K and 128K, B = 1 and 8); the probe alone (probe_one_load=0 isolates the rerank's part) and its knobs at
      # 128K; 512K, old and new; the IVF kernel tests first
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py 2>&1 | tail -1 \
        | tee "$OUT/gpu_ivf_tests.log"
      old_new ivfab "ctkvr kivf" indexer/kernels/ivf.py ;;
    s15ivf2)  # session 15: the probe's knobs and the rerank's / select's on the H200 (swept on the H100 before),
      # ctkvr at 128K; then ctkvr at 512K, the tree before (.old/ivf_head.py) and this one
      rm -rf /tmp/old && mkdir -p /tmp/old && cp -r benchmarks decoder indexer storage tests /tmp/old/ \
        && cp .old/ivf_head.py /tmp/old/indexer/kernels/ivf.py || exit 1
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 --profile --backends triton --methods ctkvr \
        ctkvr:probe_one_load=0 ctkvr:probe_warps=8 ctkvr:block_c=16 ctkvr:block_c=16,probe_warps=2 \
        ctkvr:block_c=64,probe_warps=8 ctkvr:rerank_maxnreg=128 ctkvr:chunks_per_prog=1 ctkvr:select_warps=16 \
        --out "$OUT/ivfknobs" 2>&1 | grep -E "^\| |registers"
      (cd /tmp/old && python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --backends triton --methods ctkvr \
        --out "$OUT/ivf512_old" 2>&1 | grep "^| 524288")
      python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --backends triton --methods ctkvr \
        --out "$OUT/ivf512_new" 2>&1 | grep "^| 524288" ;;
    s15dot)  # session 15 (ran on a tree with a tl.dot rerank, `IvfConfig.rerank_dot`, not kept: RESULTS.md):
      # the rerank's logits as one tl.dot (K rows kept in bf16) and the one-load probe, against the
      # tree before the session (.old/ivf_head.py): the IVF kernel tests and the GPU decode / runner tests of ctkvr
      # and kivf first; old, new (with the torch planners' agreement), the fp32 row-wise rerank (rerank_dot=0) at
      # 128K, and 512K
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py 2>&1 | tail -1 \
        | tee "$OUT/gpu_ivf_dot_tests.log"
      python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" tests/test_gpu_decode.py tests/test_runner.py \
        tests/test_kernel_schedules.py -k "ctkvr or kivf or reproducible" 2>&1 | tail -1 | tee -a "$OUT/gpu_ivf_dot_tests.log"
      rm -rf /tmp/old && mkdir -p /tmp/old && cp -r benchmarks decoder indexer storage tests /tmp/old/ \
        && cp .old/ivf_head.py /tmp/old/indexer/kernels/ivf.py || exit 1
      (cd /tmp/old && python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --backends triton \
        --methods ctkvr kivf --out "$OUT/dot_old" 2>&1 | grep "^| " | grep -v sdpa)
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --backends triton \
        --methods ctkvr kivf --torch-plans --out "$OUT/dot_new" 2>&1 | grep -E "^\| |registers" | grep -v sdpa
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 --profile --backends triton \
        --methods ctkvr:rerank_dot=0 kivf:rerank_dot=0 --out "$OUT/dot_off" 2>&1 | grep "^| " | grep -v sdpa
      python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --backends triton --methods ctkvr \
        --out "$OUT/dot512" 2>&1 | grep "^| 524288" ;;
    s15final)  # session 15, the final tree: every GPU-marked test, then ctkvr's table rows (32K and 128K, B = 1 and 8,
      # with profiles and the torch planner's agreement) and its 512K row
      python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" \
        tests/test_gpu_decode.py tests/test_triton_attention.py tests/test_backends.py tests/test_pipeline.py \
        tests/test_csattn.py tests/test_saap_device.py tests/test_runner.py tests/test_kernels_*.py \
        2>&1 | tee "$OUT/gpu_marked_tests.log" | tail -2
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --backends triton \
        --methods ctkvr --torch-plans --out "$OUT/final" 2>&1 | grep "^| " | grep -v sdpa_slice
      python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --backends triton --methods ctkvr \
        --out "$OUT/final512" 2>&1 | grep "^| 524288" ;;
    s15rerank)  # session 15: ctkvr's rerank in chunks of 32 slots (a K tile half the registers: no spills at the cap
      # of 96?) against the default 2 x 64, at 128K, B = 1, one run
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 --profile --backends triton --methods ctkvr \
        ctkvr:block_u=32,chunks_per_prog=4 ctkvr:block_u=32,chunks_per_prog=2 --out "$OUT/rerank32" 2>&1 \
        | grep -E "^\| |registers" | grep -v sdpa_slice ;;
    s14tests)  # session 14, the final tree: every GPU-marked test
      python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" \
        tests/test_gpu_decode.py tests/test_triton_attention.py tests/test_backends.py tests/test_pipeline.py \
        tests/test_csattn.py tests/test_saap_device.py tests/test_runner.py tests/test_kernels_*.py \
        2>&1 | tee "$OUT/gpu_marked_tests.log" | tail -4 ;;
    s14lfpse2e)  # session 14: lfps end to end at 128K (the runner, B = 1 and 8, dense in the same run), the tree of the
      # session's start (.old/lfps_head.py) then this one
      rm -rf /tmp/old && mkdir -p /tmp/old && cp -r benchmarks decoder indexer storage tests /tmp/old/ \
        && cp .old/lfps_head.py /tmp/old/indexer/kernels/lfps.py || exit 1
      (cd /tmp/old && python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 8 --methods full lfps \
        --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 200 --out "$OUT/lfps_e2e_old" 2>&1 | grep "^| 131072")
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 8 --methods full lfps \
        --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 200 --out "$OUT/lfps_e2e_new" 2>&1 | grep "^| 131072" ;;
    s16ahead)  # session 16: the runner's plan_ahead (layer L planned from the residual entering L - 1 on a side stream):
      # the runner's GPU tests, then 128K end to end, B = 1 and 8, with and without it, dense and streaming in the same run
      python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" tests/test_runner.py 2>&1 \
        | tee "$OUT/gpu_runner_tests.log" | tail -4
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 8 --methods full streaming psa ctkvr \
        --plan-ahead off on --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 420 --out "$OUT/ahead128" 2>&1 \
        | tee "$OUT/gpu_e2e_ahead128.log" | grep "^| \|ERROR\|Error" ;;
    s16overlap)  # session 16: how plan_ahead's side stream overlaps the layer's kernels (a replayed step's trace), 128K B = 1
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 --methods streaming psa ctkvr --plan-ahead off on \
        --profile --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 300 --out "$OUT/overlap128" 2>&1 \
        | tee "$OUT/gpu_e2e_overlap128.log" | grep "^| \|ERROR\|Error\|overlap" ;;
    s16more)  # session 16: plan_ahead for psa capped at rho, saap and kivf at 128K, B = 1 and 8, dense in the same run
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 8 --methods full psa@max_ratio=0.05 saap kivf \
        --plan-ahead off on --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 330 --out "$OUT/ahead128b" 2>&1 \
        | tee "$OUT/gpu_e2e_ahead128b.log" | grep "^| \|ERROR\|Error" ;;
    s16early)  # session 16: plan_ahead forking the next layer's plan before the layer's QKV GEMM (this tree) against
      # after its RoPE (.old/runner_head.py), alternating twice, 128K, B = 1 (`training`, which saap's rows import, was not
      # copied for the old tree in the session's run: its saap rows failed)
      rm -rf /tmp/old && mkdir -p /tmp/old && cp -r benchmarks decoder indexer storage tests training /tmp/old/ \
        && cp .old/runner_head.py /tmp/old/decoder/runner.py || exit 1
      for i in 1 2; do
        (cd /tmp/old && python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 --methods full saap \
          psa@max_ratio=0.05 ctkvr --plan-ahead off on --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 200 \
          --check-prefill 0 --out "$OUT/early_old$i" 2>&1 | grep "^| 131072")
        python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 --methods full saap psa@max_ratio=0.05 ctkvr \
          --plan-ahead off on --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 200 --check-prefill 0 \
          --out "$OUT/early_new$i" 2>&1 | grep "^| 131072"
      done ;;
    s16tests)  # session 16, the final tree: every GPU-marked test
      python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" \
        tests/test_gpu_decode.py tests/test_triton_attention.py tests/test_backends.py tests/test_pipeline.py \
        tests/test_csattn.py tests/test_saap_device.py tests/test_runner.py tests/test_kernels_*.py \
        2>&1 | tee "$OUT/gpu_marked_tests.log" | tail -4 ;;
    s17ahead)  # session 17: plan_ahead for the methods session 16 did not run with it, 128K, B = 1, dense in the same run
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 --methods full csattn lfps psa topk \
        --plan-ahead off on --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 300 --check-prefill 0 \
        --out "$OUT/ahead128c" 2>&1 | tee "$OUT/gpu_e2e_ahead128c.log" | grep "^| \|ERROR\|Error" ;;
    s17pipe)  # session 17: the runner issuing each step before reading the last one's tokens (pipelined), its GPU
      # tests, then 128K end to end, B = 1 and 8, pipelined off and on, plan_ahead off and on, dense in the same run
      python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" tests/test_runner.py 2>&1 \
        | tee "$OUT/gpu_runner_tests.log" | tail -4
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 8 --methods full streaming saap psa ctkvr \
        --pipelined off on --plan-ahead off on --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 420 \
        --check-prefill 0 --out "$OUT/pipe128" 2>&1 | tee "$OUT/gpu_e2e_pipe128.log" | grep "^| \|ERROR\|Error" ;;
    s17offload)  # session 17: ctkvr all-GPU vs offload_v (eight context copies in host memory) at 128K with pipelined
      # steps, B = 1 (profiled) and 8
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 8 --methods ctkvr --backends triton offload_v \
        --offload-batches 1 8 --offload-methods ctkvr --offload-contexts copies --profile --eager-tokens 0 \
        --hf-tokens 0 --tokens 8 --budget-s 450 --check-prefill 0 --out "$OUT/offload128" 2>&1 \
        | tee "$OUT/gpu_e2e_offload128.log" | grep "^| \|rror\|profile" ;;
    s17reads)  # session 17: offload_v's slow B = 8 (ctkvr-shaped reads of eight contexts' values in host memory)
      python3 benchmarks/gpu_host_reads.py --sections batch --out "$OUT/reads" 2>&1 | tee "$OUT/gpu_host_reads_batch.log" \
        | tail -12 ;;
    s17fuse)  # session 17: the RoPE launch also writing the step's K/V slots (this tree) against index_copy_ per request
      # and layer (.old/{runner,layer,requests}_head.py): the GPU tests of both files, then 128K end to end, old then new
      python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" tests/test_runner.py 2>&1 \
        | tee "$OUT/gpu_runner_tests.log" | tail -3
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_layer_kernels.py 2>&1 \
        | tee "$OUT/gpu_layer_kernel_tests.log" | tail -3
      rm -rf /tmp/old && mkdir -p /tmp/old && cp -r benchmarks decoder indexer storage tests training /tmp/old/ \
        && cp .old/runner_head.py /tmp/old/decoder/runner.py && cp .old/layer_head.py /tmp/old/decoder/kernels/layer.py \
        && cp .old/requests_head.py /tmp/old/decoder/requests.py || exit 1
      (cd /tmp/old && python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 8 --methods full ctkvr saap \
        --plan-ahead off on --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 200 --check-prefill 0 \
        --out "$OUT/fuse_old" 2>&1 | grep "^| 131072\|rror")
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 8 --methods full ctkvr saap --plan-ahead off on \
        --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 200 --check-prefill 0 --profile --out "$OUT/fuse_new" 2>&1 \
        | grep "^| 131072\|rror\|profile" ;;
    decode512)
      python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --backends triton \
        --methods streaming topk csattn ctkvr lfps psa saap --out "$OUT/512k" 2>&1 | tee "$OUT/gpu_decode_512k.log" \
        | grep -v "^  \|^    " ;;
    before_after)
      python3 benchmarks/decode_before_after.py --impl new --device cuda --model random --n-ctx 8192 2>&1 | tail -4
      PYTHONPATH=.old:/tmp/site python3 benchmarks/decode_before_after.py --impl old --device cuda --model random \
        --n-ctx 8192 2>&1 | tail -4 ;;
    s18pages)  # session 18: offload_v's B = 8 reads with 4 KiB pinned pages against transparent huge pages, a 2 GB
      # footprint (one layer replayed) against a 64 GB one (30 layers in turn)
      python3 benchmarks/gpu_host_reads.py --sections pages --layers 30 --out "$OUT/pages" 2>&1 \
        | tee "$OUT/gpu_host_reads_pages.log" | tail -8 ;;
    s18offprof)  # session 18: where offload_v's B = 8 step goes: ctkvr all-GPU and offload_v (context copies), 128K,
      # both profiled at B = 8
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 8 --methods ctkvr --backends triton offload_v \
        --offload-batches 8 --offload-methods ctkvr --offload-contexts copies --profile --profile-batches 8 \
        --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 400 --check-prefill 0 --out "$OUT/offprof" 2>&1 \
        | tee "$OUT/gpu_e2e_offprof.log" | grep "^| \|rror\|profile" ;;
    s18offab)  # session 18: offload_v ctkvr B = 8 (copies pinned on huge pages now): each request's attention on its own
      # stream or one after another, and the kernel's programs per SM; ctkvr all-GPU in the same run; then the GPU
      # tests of the host memory and the offload paths
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 8 --methods ctkvr --backends triton offload_v \
        --offload-batches 8 --offload-methods ctkvr --offload-contexts copies --offload-parallel on off \
        --offload-programs-per-sm 2 1 4 --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 420 --check-prefill 0 \
        --out "$OUT/offab" 2>&1 | tee "$OUT/gpu_e2e_offab.log" | grep "^| \|rror"
      python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" tests/test_host_memory.py tests/test_pipeline.py \
        tests/test_backends.py 2>&1 | tee "$OUT/gpu_host_memory_tests.log" | tail -3 ;;
    s18numa)  # session 18: the host's NUMA layout, and offload_v's B = 8 reads from huge pages bound to each node in turn
      (nvidia-smi topo -m; lscpu | grep -i "numa\|socket\|model name") 2>&1 | tee "$OUT/topology.txt"
      python3 benchmarks/gpu_host_reads.py --sections pages --layers 12 --numa --out "$OUT/numa" 2>&1 \
        | tee "$OUT/gpu_host_reads_numa.log" | tail -16 ;;
    s18staged)  # session 18: offload_v ctkvr B = 8 with plan_ahead, reading host memory in the attention or staging the
      # value rows into a GPU mirror during the layer before; all-GPU with and without plan_ahead in the same run;
      # then the GPU tests of the runner and the staging kernel
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 8 --methods ctkvr --backends triton offload_v \
        --plan-ahead off on --offload-batches 8 --offload-methods ctkvr --offload-contexts copies \
        --offload-plan-ahead off on staged --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 400 \
        --check-prefill 0 --out "$OUT/staged" 2>&1 | tee "$OUT/gpu_e2e_staged.log" | grep "^| \|rror"
      python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" tests/test_runner.py tests/test_stage_kernel.py \
        2>&1 | tee "$OUT/gpu_runner_stage_tests.log" | tail -3
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_stage_kernel.py 2>&1 \
        | tee "$OUT/gpu_stage_kernel_tests.log" | tail -2 ;;
    s18prio)  # session 18: the same staged offload_v row and all-GPU plan-ahead row with the planning side streams at
      # high CUDA priority
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 8 --methods ctkvr --backends triton offload_v \
        --plan-ahead on --offload-batches 8 --offload-methods ctkvr --offload-contexts copies \
        --offload-plan-ahead staged --ahead-priority -1 --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 300 \
        --check-prefill 0 --out "$OUT/prio" 2>&1 | tee "$OUT/gpu_e2e_prio.log" | grep "^| \|rror" ;;
    s18stprof)  # session 18: where the staged offload_v step goes: kernels and stream overlap of one replayed B = 8 step
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 8 --methods ctkvr --backends offload_v \
        --offload-batches 8 --offload-methods ctkvr --offload-contexts copies --offload-plan-ahead on staged \
        --profile --profile-batches 8 --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 300 --check-prefill 0 \
        --out "$OUT/stprof" 2>&1 | tee "$OUT/gpu_e2e_stprof.log" | grep "^| \|rror\|overlap\|profile" ;;
    s18frame)  # session 18 (ran on commit e0a3974; its `staged-hostframe` option went with the GPU frame copy, which
      # gained nothing): staged values with the frame's rows from their GPU copy against from host memory; then
      # the GPU tests of the staging kernel and of the staged runner
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 8 --methods ctkvr --backends offload_v \
        --offload-batches 8 --offload-methods ctkvr --offload-contexts copies \
        --offload-plan-ahead staged-hostframe staged --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 200 \
        --check-prefill 0 --out "$OUT/frame" 2>&1 | tee "$OUT/gpu_e2e_frame.log" | grep "^| \|rror"
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_stage_kernel.py \
        "tests/test_runner.py::test_gpu_row_cache_equals_host_reads" 2>&1 | tee "$OUT/gpu_stage_tests.log" | tail -2 ;;
    s19tests)  # session 19, the tree as it landed: every GPU-marked test, the staging kernel's and host memory's included
      python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" \
        tests/test_gpu_decode.py tests/test_triton_attention.py tests/test_backends.py tests/test_pipeline.py \
        tests/test_csattn.py tests/test_saap_device.py tests/test_runner.py tests/test_kernels_*.py \
        tests/test_host_memory.py 2>&1 | tee "$OUT/gpu_marked_tests.log" | tail -4
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_stage_kernel.py 2>&1 \
        | tee -a "$OUT/gpu_marked_tests.log" | tail -2 ;;
    s19cached)  # session 19: offload_v ctkvr B = 8 with staged values, without and with the row cache of each layer's
      # previous plan; ctkvr all-GPU in the same run; then the GPU tests of the staging kernel and the staged runner
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 8 --methods ctkvr --backends triton offload_v \
        --offload-batches 8 --offload-methods ctkvr --offload-contexts copies --offload-plan-ahead staged cached \
        --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 400 --check-prefill 0 --out "$OUT/cached" 2>&1 \
        | tee "$OUT/gpu_e2e_cached.log" | grep "^| \|rror"
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_stage_kernel.py \
        "tests/test_runner.py::test_gpu_row_cache_equals_host_reads" 2>&1 | tee "$OUT/gpu_stage_tests.log" | tail -2 ;;
    s19overlap)  # session 19: the same, with 69% of each one-token plan's slots pinned to the layer's first plan
      # (gpu_e2e.OverlappingPlans: consecutive plans overlap as the real model's do, random weights' do not), profiled
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 8 --methods ctkvr --backends triton offload_v \
        --offload-batches 8 --offload-methods ctkvr --offload-contexts copies --offload-plan-ahead staged cached \
        --plan-overlap 0.69 --profile --profile-batches 8 --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 400 \
        --check-prefill 0 --out "$OUT/overlap" 2>&1 | tee "$OUT/gpu_e2e_overlap.log" | grep "^| \|rror\|overlap" ;;
    s19sweep)  # session 19: the row cache at 35% and 70% of each plan pinned, ctkvr and csattn, all-GPU in the same run
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 8 --methods ctkvr csattn --backends triton offload_v \
        --offload-batches 8 --offload-methods ctkvr csattn --offload-contexts copies --offload-plan-ahead cached \
        --plan-overlap 0.35 0.7 --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 480 --check-prefill 0 \
        --out "$OUT/sweep" 2>&1 | tee "$OUT/gpu_e2e_sweep.log" | grep "^| \|rror" ;;
    s19gen)  # session 19: the row cache as one launch keeping the last two plans, at 69%, 76% and 82% of each plan
      # pinned (the default model's ctkvr plans: one, two and four steps back); all-GPU ctkvr in the same run
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 8 --methods ctkvr --backends triton offload_v \
        --offload-batches 8 --offload-methods ctkvr --offload-contexts copies --offload-plan-ahead cached \
        --plan-overlap 0.69 0.76 0.82 --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 300 --check-prefill 0 \
        --out "$OUT/gen" 2>&1 | tee "$OUT/gpu_e2e_gen.log" | grep "^| \|rror" ;;
    s19granule)  # session 19: scattered host reads by their size (64 B to 8 KiB) against contiguous ones
      python3 benchmarks/gpu_host_reads.py --sections granule --out "$OUT/granule" 2>&1 \
        | tee "$OUT/gpu_host_reads_granule.log" | tail -12 ;;
    s21prof)  # session 21: where a B = 1 token's time goes at 128K, kernel by kernel in start order (the profile's
      # timeline), dense, the frame alone and three methods
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 --methods full streaming psa@max_ratio=0.05 saap ctkvr \
        --profile --contexts shared --eager-tokens 0 --hf-tokens 0 --tokens 8 --check-prefill 0 --budget-s 500 \
        --out "$OUT/prof128" 2>&1 | tee "$OUT/gpu_e2e_prof128.log" | grep "^| \|ERROR\|Error\|profile" ;;
    s21l2)  # session 21: does a projection run faster from L2 after a touch of its weight during a latency-bound chain
      python3 benchmarks/gpu_l2_prefetch.py --out "$OUT/l2" 2>&1 | tee "$OUT/gpu_l2_prefetch.log" | tail -40 ;;
    s21split)  # session 21: the split kernel's latency on a frame and a psa-shaped plan over its knobs (H200)
      python3 benchmarks/gpu_split_latency.py --more --out "$OUT/split" 2>&1 | tee "$OUT/gpu_split_latency.log" | tail -40 ;;
    s21ahead)  # session 21: issue 13's B = 1 and B = 8 rows at 128K on today's tree, plan_ahead off and on, dense and
      # the frame alone in the same run
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 8 --methods full streaming psa@max_ratio=0.05 saap ctkvr \
        --plan-ahead off on --eager-tokens 0 --hf-tokens 0 --tokens 8 --check-prefill 0 --budget-s 540 \
        --out "$OUT/ahead128" 2>&1 | tee "$OUT/gpu_e2e_ahead128.log" | grep "^| \|ERROR\|Error" ;;
    s21gemv)  # session 21: a split-K Triton GEMV against cuBLAS on the 8B layer's projections, M = 1 and 8
      python3 benchmarks/gpu_gemv.py --out "$OUT/gemv" 2>&1 | tee "$OUT/gpu_gemv.log" | grep -v Warn | tail -12 ;;
    s21decode)  # session 21: issue 12's decode table on the H200 on today's kernels (every method, psa at both caps),
      # with the torch planners' agreement and the kernel profiles
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --torch-plans --backends triton \
        --methods streaming topk csattn ctkvr kivf lfps psa psa@max_ratio=0.05 saap \
        --out "$OUT/decode" 2>&1 | tee "$OUT/gpu_decode_session21.log" | grep -v "^  \|^    " ;;
    s21wide)  # session 21: what 1.5x ctkvr's budget costs at B = 1, planned ahead or not (the budget that buys back
      # plan_ahead's fidelity on the default model)
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 --methods full ctkvr ctkvr@k=1536 --plan-ahead off on \
        --eager-tokens 0 --hf-tokens 0 --tokens 8 --check-prefill 0 --budget-s 170 --out "$OUT/wide" 2>&1 \
        | tee "$OUT/gpu_e2e_wide.log" | grep "^| \|ERROR\|Error" ;;
    s22ncu)  # session 22: where the split kernel's ~8.5 us for one 128-row chunk go: ncu's stall reasons (the frame
      # alone, then psa's plan shape; 128K, B = 1), full set, clocks left alone (METHOD.md)
      ncu --clock-control none --kernel-name regex:_split_kernel --launch-skip 4 --launch-count 2 --set full \
        --import-source yes -o "$OUT/split_ncu" -f python3 benchmarks/gpu_split_latency.py --ncu 2>&1 | tail -5
      ncu --import "$OUT/split_ncu.ncu-rep" --page details > "$OUT/split_ncu_details.txt" 2>&1
      ncu --import "$OUT/split_ncu.ncu-rep" --page source --csv --print-source sass > "$OUT/split_ncu_sass.csv" 2>&1
      grep -i -E "duration|stall|warp cycles per|issued|occupancy|registers|long scoreboard|barrier" \
        "$OUT/split_ncu_details.txt" | head -60 ;;
    s22split8)  # session 22: at B = 8, what planning ahead costs kivf and csattn by itself (widen 1) and with the wider
      # budget (1.5)
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 8 --methods kivf csattn --plan-ahead off on \
        --ahead-widen 1 1.5 --eager-tokens 0 --hf-tokens 0 --tokens 8 --check-prefill 0 --budget-s 420 \
        --out "$OUT/s22split8" 2>&1 | tee "$OUT/gpu_e2e_s22split8.log" | grep "^| \|ERROR\|Error" ;;
    s22repeat)  # session 22: issue 13's B = 1 rows again on the final tree (the defaults: saap and ctkvr planned ahead
      # and widened, psa not), to see the spread between calls
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 --methods full psa@max_ratio=0.05 saap ctkvr \
        --plan-ahead off on --ahead-widen 1.5 --eager-tokens 0 --hf-tokens 0 --tokens 8 --check-prefill 0 \
        --budget-s 400 --out "$OUT/s22repeat" 2>&1 | tee "$OUT/gpu_e2e_s22repeat.log" | grep "^| \|ERROR\|Error" ;;
    s22wide1|s22wide8)  # session 22: plan_ahead with every method's budget 1.5x as wide (the service's plan_ahead_widen,
      # MethodParams.widened) against no planning ahead, dense in the same run; B = 1 (s22wide1) or B = 8 (s22wide8)
      b=${stage#s22wide}
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches "$b" --methods full psa@max_ratio=0.05 saap ctkvr csattn \
        lfps kivf --plan-ahead off on --ahead-widen 1.5 --eager-tokens 0 --hf-tokens 0 --tokens 8 --check-prefill 0 \
        --budget-s 480 --out "$OUT/$stage" 2>&1 | tee "$OUT/gpu_e2e_$stage.log" | grep "^| \|ERROR\|Error" ;;
    s22saap)  # session 22: saapwide's nprobe 48 read only 1.4% more rows than 32 on random weights (its extra buckets
      # are near empty); what saap costs at B = 1 over nprobe 32..256, i.e. as its searched rows grow, planned ahead or not
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 --methods full saap saap@nprobe=64 saap@nprobe=128 \
        saap@nprobe=256 --plan-ahead off on --eager-tokens 0 --hf-tokens 0 --tokens 8 --check-prefill 0 --budget-s 420 \
        --out "$OUT/s22saap" 2>&1 | tee "$OUT/gpu_e2e_s22saap.log" | grep "^| \|ERROR\|Error" ;;
    saapwide)  # session 22 (prepared in session 21): what 1.5x saap's probe (the wider budget that buys back
      # plan_ahead's fidelity on the default model) costs at B = 1, planned ahead or not, dense in the same run
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 --methods full saap saap@nprobe=48 --plan-ahead off on \
        --eager-tokens 0 --hf-tokens 0 --tokens 8 --check-prefill 0 --budget-s 300 --out "$OUT/saapwide" 2>&1 \
        | tee "$OUT/gpu_e2e_saapwide.log" | grep "^| \|ERROR\|Error" ;;
    s20quick)  # session 20: the attention reading the row cache, compiled: its kernel tests and the runner's GPU
      # tests of the offload backends (staged, cached, plain)
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_attention_row_cache.py tests/test_stage_kernel.py \
        "tests/test_runner.py::test_gpu_row_cache_equals_host_reads" "tests/test_runner.py::test_gpu_offload_reads_host_memory_in_place_and_equals_triton" \
        2>&1 | tee "$OUT/gpu_cache_tests.log" | tail -4 ;;
    s20cache)  # session 20: offload_v ctkvr B = 8, the attention reading the row cache (off-cached, the default; on-cached
      # with plan_ahead) against reading host memory (off) and the staged paths, random plans and 69% pinned; all-GPU too
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 8 --methods ctkvr --backends triton offload_v \
        --offload-batches 8 --offload-methods ctkvr --offload-contexts copies \
        --offload-plan-ahead off off-cached on-cached cached --plan-overlap 0.69 0 --eager-tokens 0 --hf-tokens 0 \
        --tokens 8 --budget-s 500 --check-prefill 0 --out "$OUT/cache" 2>&1 | tee "$OUT/gpu_e2e_cache.log" \
        | grep "^| \|rror" ;;
    s20more)  # session 20: the default (off-cached) with every plan slot pinned (the cache's floor: only the frame and
      # unpinned duplicates cross PCIe), then csattn (5% of the rows) read in place and through the cache at 69%
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 8 --methods ctkvr --backends triton offload_v \
        --offload-batches 8 --offload-methods ctkvr --offload-contexts copies --offload-plan-ahead off-cached \
        --plan-overlap 1.0 --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 200 --check-prefill 0 \
        --out "$OUT/pinned" 2>&1 | tee "$OUT/gpu_e2e_pinned.log" | grep "^| \|rror"
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 8 --methods csattn --backends triton offload_v \
        --offload-batches 8 --offload-methods csattn --offload-contexts copies --offload-plan-ahead off off-cached \
        --plan-overlap 0.69 --eager-tokens 0 --hf-tokens 0 --tokens 8 --budget-s 250 --check-prefill 0 \
        --out "$OUT/csattn" 2>&1 | tee "$OUT/gpu_e2e_csattn.log" | grep "^| \|rror" ;;
    s20staged)  # session 20: plan_ahead's staging without mirrors (the plan's rows staged into the row cache) against
      # the default (the attention fills the cache), ctkvr at 69% and 0% pinned, csattn at 69%; all-GPU in the same run
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 8 --methods ctkvr csattn --backends triton offload_v \
        --offload-batches 8 --offload-methods ctkvr csattn --offload-contexts copies \
        --offload-plan-ahead off-cached staged --plan-overlap 0.69 0 --eager-tokens 0 --hf-tokens 0 --tokens 8 \
        --budget-s 420 --check-prefill 0 --out "$OUT/staged" 2>&1 | tee "$OUT/gpu_e2e_staged.log" | grep "^| \|rror" ;;
    s20tests|s22tests|s23tests|s24tests|s27tests|s28tests)  # sessions 20-24, 27 and 28, the final tree: every GPU-marked test, then the kernel
      # files' CPU-shaped tests compiled
      python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" \
        tests/test_gpu_decode.py tests/test_triton_attention.py tests/test_backends.py tests/test_pipeline.py \
        tests/test_csattn.py tests/test_saap_device.py tests/test_runner.py tests/test_kernels_*.py \
        tests/test_host_memory.py 2>&1 | tee "$OUT/gpu_marked_tests.log" | tail -4
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_stage_kernel.py tests/test_attention_row_cache.py \
        2>&1 | tee -a "$OUT/gpu_marked_tests.log" | tail -2 ;;
    s23ncu)  # session 23: where psa's six kernels' ~41 us go at 128K, B = 1, capped at rho (ncu, full set, clocks left
      # alone; the steps after the first two eager ones: crit, select, sums, stop, split, merge)
      ncu --clock-control none --kernel-name regex:"_(crit|select|sums|stop|split|merge)_kernel" --launch-skip 12 \
        --launch-count 6 --set full --import-source yes -o "$OUT/psa_ncu" -f python3 benchmarks/gpu_decode.py \
        --lengths 131072 --methods psa@max_ratio=0.05 --backends triton --reps 3 2>&1 | tail -5
      ncu --import "$OUT/psa_ncu.ncu-rep" --page details > "$OUT/psa_ncu_details.txt" 2>&1
      ncu --import "$OUT/psa_ncu.ncu-rep" --page source --csv --print-source sass > "$OUT/psa_ncu_sass.csv" 2>&1
      ncu --import "$OUT/psa_ncu.ncu-rep" --page source --csv --print-source cuda > "$OUT/psa_ncu_src.csv" 2>&1
      python3 benchmarks/ncu_stalls.py "$OUT/psa_ncu_sass.csv" --json "$OUT/psa_ncu_stalls.json" | cut -c1-200
      grep -i -E "^  [a-z_]+kernel|duration|registers per|achieved occupancy|executed ipc" "$OUT/psa_ncu_details.txt" | head -60 ;;
    s23knobs)  # session 23: psa's kernel knobs ("reasoned defaults, not swept"), one at a time, 32K and 128K, B = 1,
      # capped at rho; and eps 1 (every candidate: what the adaptive stop saves the attention)
      P=psa@max_ratio=0.05
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --backends triton --profile --methods $P \
        $P:select_warps=4 $P:select_warps=16 $P:select_warps=32 $P:sums_warps=8 $P:stop_warps=8 $P:stop_parts=8 \
        $P:stop_parts=32 $P:crit_warps=8 $P:block_b=32 $P:block_b=128 $P:tile_tokens=64 $P,eps=1 \
        --out "$OUT/s23knobs" 2>&1 | tee "$OUT/gpu_decode_s23knobs.log" | grep -E "graph|Error|error" ;;
    s23splits)  # session 23: fewer splits, no merge launch? psa capped at rho and the frame alone, 32K and 128K, B = 1
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --profile --methods psa@max_ratio=0.05 streaming \
        --backends triton triton:splits=1 triton:splits=2 triton:splits=4 triton:splits=8 --out "$OUT/s23splits" 2>&1 \
        | tee "$OUT/gpu_decode_s23splits.log" | grep -E "graph|Error|error" ;;
    s23onetok)  # session 23: the split kernel's one-token mask (no division per plan row) against the general path
      # (that version was rejected; one_token now applies to planless steps only, so a rerun compares other code),
      # same run; then the attention kernel tests on the GPU
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile \
        --methods psa@max_ratio=0.05 ctkvr saap streaming csattn --backends triton:one_token=0 triton \
        --out "$OUT/s23onetok" 2>&1 | tee "$OUT/gpu_decode_s23onetok.log" | grep -E "graph|Error|error"
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_triton_attention.py tests/test_backends.py \
        2>&1 | tee "$OUT/gpu_attention_tests_s23onetok.log" | tail -3 ;;
    s23ab)  # session 23: the split kernel's one-token mask (knob one_token) and psa's select (knobs aligned_x,
      # direct_count) against the kernels before, same run; the select's rows twice in alternating order
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile \
        --methods psa@max_ratio=0.05 ctkvr saap streaming --backends triton:one_token=0 triton \
        --out "$OUT/s23ab_mask" 2>&1 | tee "$OUT/gpu_decode_s23ab_mask.log" | grep -E "graph|Error|error"
      # (the select's knobs aligned_x and direct_count were removed after this run: aligned_x lost, direct_count is
      # the only path now; the second order's JSON overwrote the first's, the log holds both)
      P=psa@max_ratio=0.05
      for n in 1 2; do
        [ $n = 1 ] && order="$P:aligned_x=0,direct_count=0 $P $P:aligned_x=0 $P:direct_count=0" \
                   || order="$P:direct_count=0 $P:aligned_x=0 $P $P:aligned_x=0,direct_count=0"
        python3 benchmarks/gpu_decode.py --lengths 32768 131072 --backends triton --profile --methods $order \
          --out "$OUT/s23ab_select_$n" 2>&1 | tee -a "$OUT/gpu_decode_s23ab_select.log" | grep -E "graph|Error|error"
      done ;;
    s23dense)  # session 23: the one-token mask and its anchoring load on steps without plan positions (dense full,
      # streaming), psa as the control (its plans keep the general mask); then dense and streaming end to end
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile \
        --methods full streaming psa@max_ratio=0.05 --backends triton:one_token=0 triton \
        --out "$OUT/s23dense_decode" 2>&1 | tee "$OUT/gpu_decode_s23dense.log" | grep -E "graph|Error|error"
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 8 --methods full streaming \
        --backends triton:one_token=0 triton --tokens 8 --eager-tokens 0 --hf-tokens 0 --check-prefill 0 \
        --budget-s 300 --out "$OUT/s23dense_e2e" 2>&1 | tee "$OUT/gpu_e2e_s23dense.log" | grep "^| \|ERROR\|Error" ;;
    s23e2e)  # session 23: the service's defaults end to end on the final tree (dense `full` now 14% faster): dense, psa
      # capped at rho, saap and ctkvr, not planned ahead and planned ahead (widened 1.5x), B = 1 and 8
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 8 --methods full psa@max_ratio=0.05 saap ctkvr \
        --plan-ahead off on --ahead-widen 1.5 --eager-tokens 0 --hf-tokens 0 --tokens 8 --check-prefill 0 \
        --budget-s 330 --out "$OUT/s23e2e" 2>&1 | tee "$OUT/gpu_e2e_s23e2e.log" | grep "^| \|ERROR\|Error" ;;
    s24attend)  # session 24: psa's plan attends the blocks it keeps (sums + attend kernel, no split / merge launches)
      # against the plan run by the attention kernel (attend=0), and the sums kernel at 8 warps; 32K and 128K, B = 1, 8
      P=psa@max_ratio=0.05
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --backends triton \
        --methods $P:attend=0 $P $P:sums_warps=8 $P:attend=0 $P --out "$OUT/s24attend" 2>&1 \
        | tee "$OUT/gpu_decode_s24attend.log" | grep -E "graph|Error|error" ;;
    s24variants)  # session 24: the attending sums kernel's variants (per-slot 2-D dots, V loaded after the scores,
      # 2 blocks per program) and the attend kernel's chunk, against attend=0; 32K and 128K, B = 1 and 8 (the
      # attend_batched / attend_late_v knobs were removed with the losing variants: this stage documents that run)
      P=psa@max_ratio=0.05
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --backends triton \
        --methods $P:attend=0 $P $P:attend_batched=0 $P:attend_late_v=1 $P:attend_batched=0,attend_late_v=1 \
        $P:tile_tokens=64 $P:attend_block=128,attend_warps=8 --out "$OUT/s24variants" 2>&1 \
        | tee "$OUT/gpu_decode_s24variants.log" | grep -E "graph|Error|error" ;;
    s24regs)  # session 24: the attending sums kernel in one wave at 128K (4 programs per SM: <= 128 registers; the
      # sums_maxnreg / attend_late_v knobs were removed after this run)
      P=psa@max_ratio=0.05
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --backends triton \
        --methods $P:attend=0 $P:sums_maxnreg=128 $P:attend_late_v=1,sums_maxnreg=128 $P:sums_maxnreg=96 \
        $P:attend_late_v=1,sums_maxnreg=96 $P:tile_tokens=64,sums_maxnreg=96 --out "$OUT/s24regs" 2>&1 \
        | tee "$OUT/gpu_decode_s24regs.log" | grep -E "graph|Error|error" ;;
    s24final)  # session 24, the final tree: psa attending its plan where it pays (B = 1, <= 2,048 candidate tokens per
      # row: 32K at rho 5%) against the triton backend running the plan (take_attended=0), 32K / 64K / 128K, B = 1 and 8;
      # forced to attend everywhere (attend_tokens) to check the bound; then psa at 32K end to end, B = 1
      P=psa@max_ratio=0.05
      python3 benchmarks/gpu_decode.py --lengths 32768 65536 131072 --batches 1 8 --profile \
        --backends triton:take_attended=0 triton --methods $P $P:attend_tokens=1000000 streaming \
        --out "$OUT/s24final_decode" 2>&1 | tee "$OUT/gpu_decode_s24final.log" | grep -E "graph|Error|error"
      python3 benchmarks/gpu_e2e.py --lengths 32768 --batches 1 --methods full $P \
        --backends triton:take_attended=0 triton --tokens 8 --eager-tokens 0 --hf-tokens 0 --check-prefill 0 \
        --budget-s 200 --out "$OUT/s24final_e2e" 2>&1 | tee "$OUT/gpu_e2e_s24final.log" | grep "^| \|ERROR\|Error" ;;
    s24stop)  # session 24: the plan's attention merged in the stop kernel (no attend launch; rejected, the tree has no
      # such variant now), B = 1, 32K and 64K, against the triton backend running the plan (take_attended=0); then
      # psa's kernel tests on the GPU
      P=psa@max_ratio=0.05
      python3 benchmarks/gpu_decode.py --lengths 32768 65536 --batches 1 --profile \
        --backends triton:take_attended=0 triton --methods $P --out "$OUT/s24stop" 2>&1 \
        | tee "$OUT/gpu_decode_s24stop.log" | grep -E "graph|Error|error"
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_psa.py 2>&1 \
        | tee "$OUT/gpu_psa_kernel_tests_s24stop.log" | tail -2 ;;
    s25ncu)  # session 25: where ctkvr's ~73 us go at 128K, B = 1 on the H200 (ncu, full set with source, clocks left
      # alone; the launches of one graph-replayed step after the eager ones), then today's baseline: ctkvr at 32K,
      # 128K and 512K, B = 1, with profiles
      ncu --clock-control none --kernel-name regex:"_(ctkvr_probe|rerank|select|split|merge|fifo_push)_kernel" \
        --launch-skip 24 --launch-count 6 --set full --import-source yes -o "$OUT/ctkvr_ncu" -f python3 \
        benchmarks/gpu_decode.py --lengths 131072 --methods ctkvr --backends triton --reps 3 2>&1 | tail -5
      ncu --import "$OUT/ctkvr_ncu.ncu-rep" --page details > "$OUT/ctkvr_ncu_details.txt" 2>&1
      ncu --import "$OUT/ctkvr_ncu.ncu-rep" --page source --csv --print-source sass > "$OUT/ctkvr_ncu_sass.csv" 2>&1
      ncu --import "$OUT/ctkvr_ncu.ncu-rep" --page source --csv --print-source cuda > "$OUT/ctkvr_ncu_src.csv" 2>&1
      python3 benchmarks/ncu_stalls.py "$OUT/ctkvr_ncu_sass.csv" --json "$OUT/ctkvr_ncu_stalls.json" | cut -c1-200
      grep -i -E "^  [a-z_]+kernel|duration|registers per|achieved occupancy|executed ipc" "$OUT/ctkvr_ncu_details.txt" \
        | head -60
      rm -f "$OUT/ctkvr_ncu_sass.csv"
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 524288 --batches 1 --profile --backends triton \
        --methods ctkvr streaming --out "$OUT/s25base" 2>&1 | tee "$OUT/gpu_decode_s25base.log" | grep -E "graph|Error|error" ;;
    s25sel)  # session 25: ctkvr / kivf's select with its mass pass split over chunk programs (the last ticket searches)
      # against the tree before (.old/ivf_head.py), alternating twice, 32K and 128K, B = 1 and 8; the chunk size; 512K;
      # the IVF kernel tests on the GPU. Documents a past run: the chunked select was reverted (commit bfed2d0), so
      # a rerun compares the tree with itself and its mass_block rows fail (no such knob)
      old_new s25sel "ctkvr kivf" indexer/kernels/ivf.py
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 --profile --backends triton --methods ctkvr \
        ctkvr:mass_block=256 ctkvr:mass_block=512 ctkvr:mass_block=2048 --out "$OUT/s25sel_mass" 2>&1 \
        | tee "$OUT/gpu_decode_s25sel_mass.log" | grep -E "graph|Error|error"
      python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --profile --backends triton --methods ctkvr \
        --out "$OUT/s25sel_512k" 2>&1 | tee "$OUT/gpu_decode_s25sel_512k.log" | grep -E "graph|Error|error"
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py 2>&1 \
        | tee "$OUT/gpu_ivf_kernel_tests_s25sel.log" | tail -2 ;;
    s25final512)  # session 25: the 512K row on the H200 on today's tree, one invocation per method (each keeps its rows
      # if the call runs out of time; each times SDPA full again), B = 1, graph, cold L2, with profiles
      for m in ctkvr psa@max_ratio=0.05 saap csattn lfps streaming; do
        python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --profile --backends triton --methods $m \
          --out "$OUT/s25_512k_${m%%@*}" 2>&1 | tee "$OUT/gpu_decode_s25_512k_${m%%@*}.log" | grep "^| 524288"
      done ;;
    s25knobs)  # session 25: ctkvr's probe and rerank knobs on the H200 since the one-load probe (last swept on the H100,
      # session 10), one at a time, 128K, B = 1 and 8, with profiles
      C=ctkvr
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --profile --backends triton --methods $C \
        $C:block_c=16 $C:block_c=64 $C:block_c=64,probe_warps=8 $C:chunks_per_prog=4 $C:block_u=32,chunks_per_prog=4 \
        $C:block_u=128,chunks_per_prog=1 $C:rerank_warps=8,rerank_maxnreg=0 $C:select_warps=4 $C \
        --out "$OUT/s25knobs" 2>&1 | tee "$OUT/gpu_decode_s25knobs.log" | grep -E "graph|Error|error" ;;
    s25pdl)  # session 25: programmatic dependent launch for CTkvr's three plan kernels (knob IvfConfig.pdl) against
      # none, in one run, twice in alternating order, 32K and 128K, B = 1 and 8; 512K, B = 1; then the IVF kernel tests
      # (documents a past run: the knob went with its revert, commit 8db2115, so a rerun fails at "unknown knob")
      L="$OUT/gpu_decode_s25pdl.log"
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --backends triton \
        --methods ctkvr:pdl=0 ctkvr --out "$OUT/s25pdl_1" 2>&1 | tee -a "$L" | grep -E "graph|Error|error"
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --backends triton \
        --methods ctkvr ctkvr:pdl=0 --out "$OUT/s25pdl_2" 2>&1 | tee -a "$L" | grep -E "graph|Error|error"
      python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --profile --backends triton \
        --methods ctkvr:pdl=0 ctkvr --out "$OUT/s25pdl_512k" 2>&1 | tee -a "$L" | grep -E "graph|Error|error"
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py 2>&1 | tee -a "$L" | tail -2 ;;
    s25attnpdl)  # session 25: the attention kernels' programmatic dependent launch (KernelConfig.pdl) against none,
      # same run, behind every seed method's plan (psa's plan kernels use PDL too; the others do not), 32K and 128K, B = 1
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 --profile --backends triton triton:pdl=0 \
        --methods ctkvr saap csattn lfps psa@max_ratio=0.05 streaming --out "$OUT/s25attnpdl" 2>&1 \
        | tee "$OUT/gpu_decode_s25attnpdl.log" | grep -E "graph|Error|error" ;;
    s25saappdl)  # session 25: saap behind the attention with and without its PDL (KernelConfig.pdl), both orders,
      # 32K and 128K, B = 1 and 8 (the s25attnpdl run saw saap 4-6 us faster without it at B = 1: it was the run order,
      # the backend timed second is the faster one)
      L="$OUT/gpu_decode_s25saappdl.log"
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --backends triton:pdl=0 triton \
        --methods saap --out "$OUT/s25saappdl_1" 2>&1 | tee -a "$L" | grep -E "graph|Error|error"
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --backends triton triton:pdl=0 \
        --methods saap --out "$OUT/s25saappdl_2" 2>&1 | tee -a "$L" | grep -E "graph|Error|error" ;;
    s25selsrc)  # session 25: where ctkvr's select spends its instructions, by source line (ncu SourceCounters, one
      # launch at 128K, B = 1, after the warm-up steps), for the next attempt at its threshold search
      ncu --clock-control none -k regex:"_select_kernel" --launch-skip 8 --launch-count 1 --section SourceCounters \
        --page source --print-source cuda,sass --csv python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 \
        --methods ctkvr --backends triton --reps 3 --out "$OUT/s25selsrc_run" > "$OUT/ncu_ctkvr_select_source.csv" 2>&1
      ls -la "$OUT/ncu_ctkvr_select_source.csv"; rm -rf "$OUT/s25selsrc_run" ;;
    s26ab)  # session 26: ctkvr's probe rank by compares (not u // RHO) in the rerank and the select, and the rerank's
      # logits masked once per chunk (14 layout conversions instead of 24; kivf's too in this run, which s26mask found
      # slower for kivf: it keeps its per-head masks), against the tree before (.old/ivf_head.py), alternating twice, 32K and 128K, B = 1 and 8; 512K, B = 1; the IVF kernel tests
      old_new s26ab "ctkvr kivf" indexer/kernels/ivf.py
      python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --profile --backends triton --methods ctkvr \
        --out "$OUT/s26ab_512k" 2>&1 | tee "$OUT/gpu_decode_s26ab_512k.log" | grep -E "graph|Error|error"
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py 2>&1 \
        | tee "$OUT/gpu_ivf_kernel_tests_s26ab.log" | tail -2 ;;
    s26mask)  # session 26: which of s26ab's two changes moved which method: the rerank's one mask per chunk on
      # (default) and off (knob IvfConfig.one_mask), ctkvr and kivf, both orders, 128K, B = 1 and 8. Documents a past
      # run: the knob went after it (CTkvr masks once, kivf per head: `_group_logits`), so a rerun fails at "unknown knob"
      L="$OUT/gpu_decode_s26mask.log"
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --profile --backends triton \
        --methods ctkvr ctkvr:one_mask=0 kivf kivf:one_mask=0 --out "$OUT/s26mask_1" 2>&1 | tee -a "$L" | grep -E "graph|Error|error"
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --profile --backends triton \
        --methods ctkvr:one_mask=0 ctkvr kivf:one_mask=0 kivf --out "$OUT/s26mask_2" 2>&1 | tee -a "$L" | grep -E "graph|Error|error" ;;
    s26probe)  # session 26: CTkvr's probe cosines on tensor cores (IvfConfig.probe_dot, the default) against the
      # CUDA-core one-load probe, both orders, 32K and 128K, B = 1 and 8 (the first run with the torch planner's
      # agreement); 512K, B = 1; the IVF kernel tests on the GPU. Documents a past run: the tensor-core probe was
      # no faster and went with its revert, so a rerun fails at "unknown knob"
      L="$OUT/gpu_decode_s26probe.log"
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --backends triton --torch-plans \
        --methods ctkvr ctkvr:probe_dot=0 --out "$OUT/s26probe_1" 2>&1 | tee -a "$L" | grep -E "graph|Error|error"
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --backends triton \
        --methods ctkvr:probe_dot=0 ctkvr --out "$OUT/s26probe_2" 2>&1 | tee -a "$L" | grep -E "graph|Error|error"
      python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --profile --backends triton \
        --methods ctkvr ctkvr:probe_dot=0 --out "$OUT/s26probe_512k" 2>&1 | tee -a "$L" | grep -E "graph|Error|error"
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py 2>&1 \
        | tee "$OUT/gpu_ivf_kernel_tests_s26probe.log" | tail -2 ;;
    s26selw)  # session 26: the select's warps and block again on the H200 after its rank-by-compares change (16 warps
      # were slower on the H100 in session 10, 4 were 10 us slower here in session 25), 128K, B = 1 and 8
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --profile --backends triton --methods ctkvr \
        ctkvr:select_warps=16 ctkvr:select_warps=16,select_block=4096 ctkvr:select_block=4096 ctkvr kivf \
        kivf:select_warps=16 --out "$OUT/s26selw" 2>&1 | tee "$OUT/gpu_decode_s26selw.log" | grep -E "graph|Error|error" ;;
    s26push)  # session 26: how much of ctkvr's select is the FIFO push's selection (the second program of each push
      # row, top-rho of the same keys): ctkvr without its FIFO (fifo=0: no push, one program per row) against the
      # default, both orders, 128K, B = 1
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 --profile --backends triton --methods ctkvr \
        ctkvr@fifo=0 ctkvr@fifo=0 ctkvr --out "$OUT/s26push" 2>&1 | tee "$OUT/gpu_decode_s26push.log" | grep -E "graph|Error|error" ;;
    s26final)  # session 26: the final tree: the IVF kernel tests on the GPU, then ctkvr and kivf at 32K and 128K, B = 1
      # and 8 (with the torch planner's agreement), and ctkvr at 512K, B = 1, with profiles
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py 2>&1 \
        | tee "$OUT/gpu_ivf_kernel_tests_s26final.log" | tail -2
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --backends triton --torch-plans \
        --methods ctkvr kivf --out "$OUT/s26final" 2>&1 | tee "$OUT/gpu_decode_s26final.log" | grep -E "graph|Error|error"
      python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --profile --backends triton --methods ctkvr \
        --out "$OUT/s26final_512k" 2>&1 | tee "$OUT/gpu_decode_s26final_512k.log" | grep -E "graph|Error|error" ;;
    s27ab)  # session 27: CTkvr's probe picks as one int64 max each (value and id packed; was a max and a min), and the
      # probe's last program per row merging the blocks' bests (IvfConfig.probe_merge, the default; 0: every rerank
      # program merges them, with the packed picks too), against the tree before (.old/ivf_head.py), alternating
      # twice (old, new, new:probe_merge=0; then the reverse), 32K and 128K, B = 1 and 8; 512K, B = 1; the IVF kernel tests.
      # Documents a past run: the merge in the probe was slower (probe +3 us, rerank -1.5) and went with its knob, so
      # a rerun fails at "unknown knob"
      L="$OUT/gpu_decode_s27ab.log"
      rm -rf /tmp/old && mkdir -p /tmp/old && cp -r benchmarks decoder indexer storage tests /tmp/old/ \
        && cp .old/ivf_head.py /tmp/old/indexer/kernels/ivf.py
      for i in 1 2; do
        [ $i = 1 ] && (cd /tmp/old && python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile \
          --backends triton --methods ctkvr --out "$OUT/s27ab_old$i" 2>&1 | tee -a "$L" | grep -E "graph|Error|error")
        python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --backends triton \
          --methods $([ $i = 1 ] && echo "ctkvr ctkvr:probe_merge=0" || echo "ctkvr:probe_merge=0 ctkvr") \
          $([ $i = 1 ] && echo --torch-plans) --out "$OUT/s27ab_new$i" 2>&1 | tee -a "$L" | grep -E "graph|Error|error"
        [ $i = 2 ] && (cd /tmp/old && python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile \
          --backends triton --methods ctkvr --out "$OUT/s27ab_old$i" 2>&1 | tee -a "$L" | grep -E "graph|Error|error")
      done
      (cd /tmp/old && python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --profile --backends triton \
        --methods ctkvr --out "$OUT/s27ab_old_512k" 2>&1 | tee -a "$L" | grep -E "graph|Error|error")
      python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --profile --backends triton --methods ctkvr \
        ctkvr:probe_merge=0 --out "$OUT/s27ab_new_512k" 2>&1 | tee -a "$L" | grep -E "graph|Error|error"
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py 2>&1 \
        | tee "$OUT/gpu_ivf_kernel_tests_s27ab.log" | tail -2 ;;
    s27kivf)  # session 27: kivf's rerank and select stop at the row's probed keys (SEL_CUM[r, P], read on the device)
      # instead of running over the static width's padding, against the tree before it (.old/ivf_head.py: the packed
      # probe picks already in), alternating twice, 32K and 128K, B = 1 and 8; the IVF kernel tests
      old_new s27kivf "kivf" indexer/kernels/ivf.py 2>&1 | tee "$OUT/gpu_decode_s27kivf.log"
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py 2>&1 \
        | tee "$OUT/gpu_ivf_kernel_tests_s27kivf.log" | tail -2 ;;
    s27kivfknobs)  # session 27: kivf's select and rerank knobs again now that they stop at the probed keys (~26K live
      # slots per row at 128K: a sampled band may pass a 2,048-key block), 128K, B = 1 and 8, the default first and last
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --profile --backends triton --methods kivf \
        kivf:select_block=4096,select_warps=16 kivf:select_warps=16 kivf:chunks_per_prog=4 kivf:block_u=32,chunks_per_prog=4 \
        kivf --out "$OUT/s27kivfknobs" 2>&1 | tee "$OUT/gpu_decode_s27kivfknobs.log" | grep -E "graph|Error|error" ;;
    s27kivfsel)  # session 27: kivf's select at 4,096-key blocks and 16 warps against 2,048 / 8, both orders, 32K and 128K,
      # B = 1 and 8; the IVF kernel tests. The run itself made 4,096 / 16 kivf's default at every width (knobs
      # kivf_select_block / _warps); it won at 128K and lost at 32K, so now rows of at least wide_select_from slots
      # take it, whatever the method: this stage compares the default with the wide select switched off
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --backends triton --methods kivf \
        kivf:wide_select_from=1000000000 kivf --out "$OUT/s27kivfsel" 2>&1 \
        | tee "$OUT/gpu_decode_s27kivfsel.log" | grep -E "graph|Error|error"
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py 2>&1 \
        | tee "$OUT/gpu_ivf_kernel_tests_s27kivfsel.log" | tail -2 ;;
    s28dot)  # session 28: the rerank's logits on tensor cores (IvfConfig.rerank_dot) against the row-wise FMAs, the
      # FMA rows first and last; its pipelining, chunk shape and register cap; the IVF kernel tests first
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py 2>&1 \
        | tee "$OUT/gpu_ivf_kernel_tests_s28dot.log" | tail -2
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --backends triton --torch-plans \
        --methods ctkvr:rerank_dot=0 ctkvr ctkvr:rerank_stages=2 ctkvr:block_u=128,chunks_per_prog=1 \
        ctkvr:rerank_maxnreg=128 ctkvr:rerank_dot=0 --out "$OUT/s28dot" 2>&1 | tee "$OUT/gpu_decode_s28dot.log" \
        | grep -E "graph|Error|error" ;;
    s28kivf)  # session 28: kivf's rerank on tensor cores against its FMAs (both orders); ctkvr at 512K both ways
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --backends triton --torch-plans \
        --methods kivf:rerank_dot=0 kivf kivf:rerank_dot=0 --out "$OUT/s28kivf" 2>&1 \
        | tee "$OUT/gpu_decode_s28kivf.log" | grep -E "graph|Error|error"
      python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --profile --backends triton \
        --methods ctkvr ctkvr:rerank_dot=0 ctkvr --out "$OUT/s28dot_512k" 2>&1 | tee "$OUT/gpu_decode_s28dot_512k.log" \
        | grep -E "graph|Error|error" ;;
    s28knobs)  # session 28: the tensor-core rerank's register cap, warps and chunks at 128K (the default first and last)
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --profile --backends triton \
        --methods ctkvr ctkvr:rerank_maxnreg=64 ctkvr:rerank_maxnreg=80 ctkvr:chunks_per_prog=1 \
        ctkvr:chunks_per_prog=4 ctkvr:rerank_warps=8,rerank_maxnreg=0 ctkvr:eager_rows=0 ctkvr \
        --out "$OUT/s28knobs" 2>&1 | tee "$OUT/gpu_decode_s28knobs.log" | grep -E "graph|Error|error" ;;
    s28exp)  # session 28: the select's masses as multiplies of the rerank's exponentials (IvfConfig.exp_mass, removed
      # after this run: select -0.9 us, step unchanged, kivf slower) against its exponentials, both orders, CTkvr and
      # kivf; the rerank's 80-register cap; the IVF kernel tests
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py 2>&1 \
        | tee "$OUT/gpu_ivf_kernel_tests_s28exp.log" | tail -2
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --backends triton --torch-plans \
        --methods ctkvr:exp_mass=0 ctkvr ctkvr:rerank_maxnreg=80 ctkvr:exp_mass=0 kivf:exp_mass=0 kivf \
        --out "$OUT/s28exp" 2>&1 | tee "$OUT/gpu_decode_s28exp.log" | grep -E "graph|Error|error" ;;
    s28piv)  # session 28: the select's search in registers with 5 split points per step (IvfConfig.select_pivots,
      # removed after this run: no faster) against the bisection, both orders; kivf at 128K; ctkvr at 512K; the IVF
      # kernel tests first
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py 2>&1 \
        | tee "$OUT/gpu_ivf_kernel_tests_s28piv.log" | tail -2
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --backends triton --torch-plans \
        --methods ctkvr:select_pivots=0 ctkvr ctkvr:select_pivots=3 ctkvr:select_pivots=0 ctkvr --out "$OUT/s28piv" 2>&1 \
        | tee "$OUT/gpu_decode_s28piv.log" | grep -E "graph|Error|error"
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --profile --backends triton \
        --methods kivf:select_pivots=0 kivf --out "$OUT/s28piv_kivf" 2>&1 | tee "$OUT/gpu_decode_s28piv_kivf.log" \
        | grep -E "graph|Error|error"
      python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --profile --backends triton \
        --methods ctkvr ctkvr:select_pivots=0 ctkvr --out "$OUT/s28piv_512k" 2>&1 | tee "$OUT/gpu_decode_s28piv_512k.log" \
        | grep -E "graph|Error|error" ;;
    s28pf)  # session 28, the last device minutes: the select's counting pass with its next chunk's loads in flight
      # (IvfConfig.select_prefetch, removed after this run: select 0.6 us slower) against loads in turn, at 128K,
      # B = 1 and 8, both orders; then the IVF kernel tests
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --profile --backends triton --torch-plans \
        --methods ctkvr:select_prefetch=0 ctkvr ctkvr:select_prefetch=0 ctkvr --out "$OUT/s28pf" 2>&1 \
        | tee "$OUT/gpu_decode_s28pf.log" | grep -E "graph|Error|error"
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py 2>&1 \
        | tee "$OUT/gpu_ivf_kernel_tests_s28pf.log" | tail -2 ;;
    s29tl)  # session 29: the timeline of one ctkvr / kivf step from the kernels' own timestamps (gpu_timeline.py)
      python3 benchmarks/gpu_timeline.py --lengths 131072 524288 --methods ctkvr --tag _s29tl 2>&1 \
        | tee "$OUT/gpu_timeline_s29tl.log" | grep -v "^ *$"
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods kivf --tag _s29tl_kivf 2>&1 \
        | tee -a "$OUT/gpu_timeline_s29tl.log" | grep -v "^ *$" ;;
    s29probe)  # session 29: the probe in one wave? (528 programs at 181 registers run as two waves of 264); timelines.
      # Documents a run: its knob (IvfConfig.probe_maxnreg) was removed after it (no faster, RESULTS.md)
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods ctkvr ctkvr:probe_maxnreg=128 ctkvr:block_c=64 \
        ctkvr:probe_one_load=0 ctkvr:probe_maxnreg=128,block_c=16 ctkvr:probe_warps=8 ctkvr --tag _s29probe 2>&1 \
        | tee "$OUT/gpu_timeline_s29probe.log" | grep -v "^ *$" ;;
    s29keys)  # session 29: the select's mass pass with its loads a chunk ahead (the dedup words included) and the
      # first chunk's before the parts' lse, against the tree before (.old/ivf_head.py): timelines alternating twice,
      # then gpu_decode's A/B (old_new), then the IVF kernel tests. Here .old/ivf_head.py was the tree and ivf.py the
      # change (slower, not kept: RESULTS.md, session 29); the run reached the 600 s limit during the tests
      rm -rf /tmp/old && mkdir -p /tmp/old && cp -r benchmarks decoder indexer storage tests /tmp/old/ \
        && cp .old/ivf_head.py /tmp/old/indexer/kernels/ivf.py
      for i in 1 2; do
        (cd /tmp/old && python3 benchmarks/gpu_timeline.py --lengths 131072 --methods ctkvr kivf --out "$OUT" \
          --tag _s29keys_old$i) 2>&1 | tee -a "$OUT/gpu_timeline_s29keys.log" | grep -E "graph|phases"
        python3 benchmarks/gpu_timeline.py --lengths 131072 --methods ctkvr kivf --out "$OUT" --tag _s29keys_new$i 2>&1 \
          | tee -a "$OUT/gpu_timeline_s29keys.log" | grep -E "graph|phases"
      done
      old_new s29keys "ctkvr kivf" indexer/kernels/ivf.py 2>&1 | tee "$OUT/gpu_decode_s29keys.log"
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py 2>&1 \
        | tee "$OUT/gpu_ivf_kernel_tests_s29keys.log" | tail -2 ;;
    s29pdl)  # session 29: programmatic dependent launch between CTkvr's kernels again, now with the timeline: rerank ->
      # select (-> attention), probe -> rerank (the probe's two waves with the rerank's programs launched early; and capped
      # at 128 registers, one wave); timelines at 128K, then gpu_decode at 128K, B = 1 and 8. Documents a run: its
      # knobs (IvfConfig.pdl_select, pdl_rerank, probe_maxnreg) were removed after it (RESULTS.md, session 29)
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods ctkvr ctkvr:pdl_select=1 ctkvr:pdl_rerank=1 \
        ctkvr:pdl_rerank=1,probe_maxnreg=128 ctkvr:pdl_select=1,pdl_rerank=1,probe_maxnreg=128 ctkvr --tag _s29pdl 2>&1 \
        | tee "$OUT/gpu_timeline_s29pdl.log" | grep -v "^ *$"
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --profile --backends triton --methods ctkvr \
        ctkvr:pdl_select=1 ctkvr:pdl_select=1,pdl_rerank=1,probe_maxnreg=128 ctkvr --out "$OUT/s29pdl" 2>&1 \
        | tee "$OUT/gpu_decode_s29pdl.log" | grep -E "graph|Error|error" ;;
    s29final)  # session 29, the final tree: ctkvr's timeline at 128K and 512K, then the stamps' GPU test, the IVF
      # kernel tests and the attention kernel tests on the GPU
      python3 benchmarks/gpu_timeline.py --lengths 131072 524288 --methods ctkvr --tag _s29final 2>&1 \
        | tee "$OUT/gpu_timeline_s29final.log" | grep -v "^ *$"
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_stamps.py tests/test_kernels_ivf.py \
        tests/test_triton_attention.py 2>&1 | tee "$OUT/gpu_tests_s29final.log" | tail -4 ;;
    s29cb)  # session 29, the last device minutes: the select's counting pass over chunks of 4,096, 8,192 and 16,384 keys
      # (IvfConfig.count_block; one chunk for CTkvr's 10,240 slots) against the select block's 2,048; timelines at 128K.
      # Documents a run: the knob was removed after it (slower with every size, RESULTS.md session 29)
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods ctkvr ctkvr:count_block=4096 ctkvr:count_block=8192 \
        ctkvr:count_block=16384 ctkvr --tag _s29cb 2>&1 | tee "$OUT/gpu_timeline_s29cb.log" | grep -E "graph|select plan" ;;
    s30scan)  # session 30: the select's counting pass with 8 consecutive keys per thread (IvfConfig.count_rows, the
      # default) against 1 (the layout before), 4 and 16: timelines at 128K (ctkvr, kivf), gpu_decode at 128K and
      # 512K
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods ctkvr ctkvr:count_rows=1 ctkvr:count_rows=4 \
        ctkvr:count_rows=16 ctkvr:count_rows=1 ctkvr kivf kivf:count_rows=1 kivf --tag _s30scan 2>&1 \
        | tee "$OUT/gpu_timeline_s30scan.log" | grep -E "graph|_select|select plan|phases"
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --backends triton --methods ctkvr \
        ctkvr:count_rows=1 ctkvr --out "$OUT/s30scan" 2>&1 | tee "$OUT/gpu_decode_s30scan.log" | grep -E "graph|Error|error"
      python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --backends triton --methods ctkvr \
        ctkvr:count_rows=1 ctkvr --out "$OUT/s30scan512" 2>&1 | tee -a "$OUT/gpu_decode_s30scan.log" \
        | grep -E "graph|Error|error" ;;
    s30scan2)  # session 30: count_rows 4, 2, 8 and 1 with the band's emit in the same layout (count_rows > 1); kivf
      # with 4 and 8 (16 warps, 4,096-key chunks); gpu_decode at 128K with 4 against 8
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods ctkvr:count_rows=4 ctkvr:count_rows=2 \
        ctkvr:count_rows=8 ctkvr:count_rows=1 ctkvr:count_rows=4 kivf:count_rows=4 kivf:count_rows=8 \
        kivf:count_rows=4 --tag _s30scan2 2>&1 | tee "$OUT/gpu_timeline_s30scan2.log" | grep -E "graph|select plan"
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --backends triton --methods ctkvr:count_rows=4 \
        ctkvr:count_rows=8 ctkvr:count_rows=4 kivf:count_rows=4 kivf:count_rows=8 --out "$OUT/s30scan2" 2>&1 \
        | tee "$OUT/gpu_decode_s30scan2.log" | grep -E "graph|Error|error" ;;
    s30tests)  # session 30, the final tree (count_rows 4): the IVF, psa (the attend kernel's masked merge) and stamps
      # kernel tests on the GPU, then ctkvr's timeline at 128K and 512K and gpu_decode at 512K, B = 1
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py tests/test_kernels_psa.py \
        tests/test_stamps.py 2>&1 | tee "$OUT/gpu_tests_s30tests.log" | tail -4
      python3 benchmarks/gpu_timeline.py --lengths 131072 524288 --methods ctkvr --tag _s30final 2>&1 \
        | tee "$OUT/gpu_timeline_s30final.log" | grep -E "graph|select plan"
      python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --backends triton --methods ctkvr \
        --out "$OUT/s30final512" 2>&1 | tee "$OUT/gpu_decode_s30final512.log" | grep -E "graph|Error|error" ;;
    s30knobs)  # session 30: the select's warps and block again, now that its scans hold four keys per thread
      # (timelines at 128K), and the attention's 64-row chunks for ctkvr's plan (gpu_decode at 128K)
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods ctkvr ctkvr:select_warps=4 ctkvr:select_warps=16 \
        ctkvr:select_block=1024 ctkvr:select_block=4096 ctkvr:select_block=4096,count_rows=8 ctkvr --tag _s30knobs 2>&1 \
        | tee "$OUT/gpu_timeline_s30knobs.log" | grep -E "graph|select plan"
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --backends triton triton:block_n=64 triton \
        --methods ctkvr --out "$OUT/s30knobs" 2>&1 | tee "$OUT/gpu_decode_s30knobs.log" | grep -E "graph|Error|error" ;;
    s30l2)  # session 30: a flush that leaves the L2 clean (read, not zeroed) against the usual zeroing flush, whose
      # dirty lines a step's misses must write back first: ctkvr's timeline at 128K both ways, then gpu_decode
      # (graph and graph_clean_l2 rows) for ctkvr and psa at 128K (B = 1, 8) and 512K (B = 1)
      for l2 in cold clean; do
        python3 benchmarks/gpu_timeline.py --lengths 131072 --methods ctkvr --l2 $l2 --tag _s30l2_$l2 2>&1 \
          | tee -a "$OUT/gpu_timeline_s30l2.log" | grep -E "graph|_probe|_rerank|_select|_split|_merge"
      done
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --backends triton --methods ctkvr psa --l2 clean \
        --out "$OUT/s30l2" 2>&1 | tee "$OUT/gpu_decode_s30l2.log" | grep -E "sdpa|graph|Error|error"
      python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --backends triton --methods ctkvr --l2 clean \
        --out "$OUT/s30l2_512" 2>&1 | tee -a "$OUT/gpu_decode_s30l2.log" | grep -E "sdpa|graph|Error|error" ;;
    s30pdl)  # session 30: the select launched with PDL, let in by the rerank once all its programs started, and not
      # letting the attention in early (IvfConfig.pdl_select, on in that tree) against off: timelines at 128K
      # alternating twice, gpu_decode at 128K (B = 1, 8) and 512K, then the IVF and stamps GPU tests with it on.
      # Documents a run: the knob (and pdl.py's pdl_wait / pdl_trigger) was removed after it (no faster, RESULTS.md)
      for i in 1 2; do
        python3 benchmarks/gpu_timeline.py --lengths 131072 --methods ctkvr:pdl_select=0 ctkvr kivf:pdl_select=0 kivf \
          --tag _s30pdl$i 2>&1 | tee -a "$OUT/gpu_timeline_s30pdl.log" | grep -E "graph|select \||gaps"
      done
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --backends triton --methods ctkvr:pdl_select=0 \
        ctkvr ctkvr:pdl_select=0 ctkvr --out "$OUT/s30pdl" 2>&1 | tee "$OUT/gpu_decode_s30pdl.log" | grep -E "graph|Error|error"
      python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --backends triton --methods ctkvr:pdl_select=0 ctkvr \
        --out "$OUT/s30pdl512" 2>&1 | tee -a "$OUT/gpu_decode_s30pdl.log" | grep -E "graph|Error|error"
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py tests/test_stamps.py 2>&1 \
        | tee "$OUT/gpu_tests_s30pdl.log" | tail -3 ;;
    s31split)  # session 31: one selection shared by several select programs (IvfConfig.select_parts: 0 = one per
      # chunk of the row, the default; 1 = one program per selection, the kernel before). s31split, s31split2 and
      # s31split3 document runs of commit d6df997's versions: the knob (and indexer.kernels.concurrent) was removed
      # after them (no faster, RESULTS.md session 31)
      s31_split s31split && s31_split_decode s31split ;;
    s31split2)  # session 31, the second version: the sample's keys from the logits alone, the last program's
      # gathers issued at once, and a batch's concurrent requests keeping one program per selection
      # (indexer.kernels.concurrent); the same runs as s31split
      s31_split s31split2 && s31_split_decode s31split2 ;;
    s31split3)  # session 31, the third version: s31split2 with the sample's dedup back (without it CTkvr's guesses
      # were refuted); gpu_decode at B = 1 only
      s31_split s31split3
      python3 benchmarks/gpu_decode.py --lengths 131072 524288 --batches 1 --backends triton --methods ctkvr \
        ctkvr:select_parts=1 ctkvr --out "$OUT/s31split3" 2>&1 | tee "$OUT/gpu_decode_s31split3.log" \
        | grep -E "sdpa|graph|Error|error" ;;
    s31rerank)  # session 31: the rerank's next-chunk list loads issued early (IvfConfig.rerank_prefetch) and the
      # probe bests' top-4 in one reduction (IvfConfig.merge_reduce), both on by default, against off, each alone:
      # the IVF kernel tests on the GPU, ctkvr timelines at 128K, gpu_decode at 128K and 512K (B = 1). Documents a
      # run of commit e5edcdf: merge_reduce was removed after it (slower)
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py 2>&1 \
        | tee "$OUT/gpu_tests_s31rerank.log" | tail -3
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods ctkvr ctkvr:rerank_prefetch=0,merge_reduce=0 \
        ctkvr:rerank_prefetch=0 ctkvr:merge_reduce=0 ctkvr ctkvr:rerank_prefetch=0,merge_reduce=0 --tag _s31rerank \
        2>&1 | tee "$OUT/gpu_timeline_s31rerank.log" | grep -E "graph|_rerank|rerank phases"
      python3 benchmarks/gpu_decode.py --lengths 131072 524288 --batches 1 --backends triton --methods ctkvr \
        ctkvr:rerank_prefetch=0,merge_reduce=0 ctkvr --out "$OUT/s31rerank" 2>&1 \
        | tee "$OUT/gpu_decode_s31rerank.log" | grep -E "sdpa|graph|Error|error" ;;
    s31prefetch)  # session 31, the final tree: the rerank's prefetch alone (IvfConfig.rerank_prefetch, on) against
      # off: CTkvr's kernel tests on the GPU, timelines at 128K alternating twice, gpu_decode at 128K and 512K (B = 1)
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py -k ctkvr 2>&1 \
        | tee "$OUT/gpu_tests_s31prefetch.log" | tail -2
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods ctkvr ctkvr:rerank_prefetch=0 ctkvr \
        ctkvr:rerank_prefetch=0 --tag _s31prefetch 2>&1 | tee "$OUT/gpu_timeline_s31prefetch.log" \
        | grep -E "graph|_rerank |rerank phases"
      python3 benchmarks/gpu_decode.py --lengths 131072 524288 --batches 1 --backends triton --methods ctkvr \
        ctkvr:rerank_prefetch=0 ctkvr --out "$OUT/s31prefetch" 2>&1 | tee "$OUT/gpu_decode_s31prefetch.log" \
        | grep -E "sdpa|graph|Error|error" ;;
    s32floors)  # session 32: the memory floors of ctkvr's probe and split kernels against the kernels
      # (benchmarks/gpu_floors.py), then Nsight Compute's memory and warp-state sections on both at 128K
      python3 benchmarks/gpu_floors.py 2>&1 | tee "$OUT/gpu_floors_s32.log" | grep -v "^  "
      for k in ctkvr_probe split; do
        /usr/local/cuda/bin/ncu -k regex:"_${k}_kernel" --launch-count 1 --section SpeedOfLight \
          --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats --section Occupancy \
          python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 --methods ctkvr --backends triton --reps 2 \
          --out "$OUT/ncu_run" > "$OUT/ncu_s32_${k}.txt" 2>&1
        grep -i "duration\|dram throughput\|memory throughput\|registers per\|achieved occ\|warp cycles per issued\|l2 hit\|l1/tex hit\|stall" \
          "$OUT/ncu_s32_${k}.txt" | head -24
      done
      rm -rf "$OUT/ncu_run" ;;
    s32probe)  # session 32: the probe's table chosen per program (IvfConfig.probe_fifo_blocks, on) against per
      # element, and with a 128-register cap (probe_maxnreg): CTkvr's kernel tests on the GPU, timelines at 128K
      # alternating twice, gpu_decode at 128K (B = 1, 8) and 512K (B = 1)
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py -k ctkvr 2>&1 \
        | tee "$OUT/gpu_tests_s32probe.log" | tail -2
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods ctkvr ctkvr:probe_fifo_blocks=0 \
        ctkvr:probe_maxnreg=128 ctkvr ctkvr:probe_fifo_blocks=0 ctkvr:probe_maxnreg=128 --tag _s32probe 2>&1 \
        | tee "$OUT/gpu_timeline_s32probe.log" | grep -E "graph|\| probe |\| rerank |gaps"
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --backends triton --methods ctkvr \
        ctkvr:probe_fifo_blocks=0 ctkvr:probe_maxnreg=128 ctkvr --out "$OUT/s32probe" 2>&1 \
        | tee "$OUT/gpu_decode_s32probe.log" | grep -E "sdpa|graph|Error|error"
      python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --backends triton --methods ctkvr \
        ctkvr:probe_fifo_blocks=0 ctkvr:probe_maxnreg=128 ctkvr --out "$OUT/s32probe_512" 2>&1 \
        | tee -a "$OUT/gpu_decode_s32probe.log" | grep -E "sdpa|graph|Error|error" ;;
    s32loads)  # session 32: the probe issuing its centroid rows' loads before the query's and the push count's
      # (and its table per program), against the tree before (.old/ivf_head.py = `git show 1130e35:indexer/kernels/ivf.py`),
      # alternating twice: CTkvr's kernel tests on the GPU, timelines at 128K, gpu_decode at 128K (B = 1, 8), 512K
      # (the session's call ran both timelines before both gpu_decode pairs)
      s32_old indexer/kernels/ivf.py "ctkvr or probe" test_kernels_ivf.py s32loads || exit 1
      for i in 1 2; do
        s32_ab s32loads $i "ctkvr" "--backends triton --methods ctkvr" "--backends triton --methods ctkvr" \
          "graph|\| probe |\| rerank "
      done
      s32_512 s32loads "ctkvr" new512
      (cd /tmp/old && s32_512 s32loads "ctkvr" old512) ;;
    s32order)  # session 32: the probe's load order alone (IvfConfig.probe_loads_first) on and off, with the table
      # per program, against the tree before (.old/ivf_head.py, as s32loads), alternating twice: CTkvr's kernel tests
      # on the GPU, timelines at 128K, gpu_decode at 128K (B = 1, 8), 512K once
      s32_old indexer/kernels/ivf.py "ctkvr or probe" test_kernels_ivf.py s32order || exit 1
      for i in 1 2; do
        s32_ab s32order $i "ctkvr ctkvr:probe_loads_first=0" \
          "--backends triton --methods ctkvr ctkvr:probe_loads_first=0" "--backends triton --methods ctkvr" \
          "graph|\| probe "
      done
      s32_512 s32order "ctkvr ctkvr:probe_loads_first=0" new512 ;;
    s32pos)  # session 32: the split kernel loading its first chunk's plan positions first and the query rows in the
      # chunk loop, against the tree before (.old/attention_head.py = `git show b4a1ec2:decoder/kernels/attention.py`),
      # alternating twice: the attention kernel tests on the GPU, ctkvr timelines at 128K, gpu_decode at 128K (B = 1,
      # 8; ctkvr with one pipeline stage too; psa once), 512K once. Documents a run of commit e607d50 (reverted)
      s32_old decoder/kernels/attention.py "" test_triton_attention.py s32pos || exit 1
      for i in 1 2; do
        s32_ab s32pos $i "ctkvr" "--backends triton triton:num_stages=1 --methods ctkvr $([ $i = 1 ] && echo psa)" \
          "--backends triton --methods ctkvr $([ $i = 1 ] && echo psa)" "graph|\| split |\| merge "
      done
      s32_512 s32pos "ctkvr" new512 ;;
    s32floors3)  # session 32: gpu_floors.py again, with the probe's session-32 constexprs (FIFO_BLOCKS, LOADS_FIRST)
      python3 benchmarks/gpu_floors.py 2>&1 | tee "$OUT/gpu_floors_s32floors3.log" | grep -E "probe|stream block_c=32" ;;
    s32final)  # session 32, the final tree: the probe's table per program and load order against each off, once
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods ctkvr ctkvr:probe_fifo_blocks=0 \
        ctkvr:probe_fifo_blocks=0,probe_loads_first=0 --tag _s32final 2>&1 | tee "$OUT/gpu_timeline_s32final.log" \
        | grep -E "graph|\| probe "
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --backends triton --methods ctkvr \
        ctkvr:probe_fifo_blocks=0 ctkvr:probe_fifo_blocks=0,probe_loads_first=0 --reps 20 --out "$OUT/s32final" 2>&1 \
        | tee "$OUT/gpu_decode_s32final.log" | grep -E "graph" ;;
    s33rerank)  # prepared in session 32, for the next: the rerank reading the query position after its merge's and
      # lists' loads (IvfConfig.rerank_loads_first, off by default) against the default, alternating twice: the IVF
      # kernel tests on the GPU, timelines at 128K (ctkvr, kivf), gpu_decode at 128K (B = 1, 8) and 512K (B = 1)
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py 2>&1 \
        | tee "$OUT/gpu_tests_s33rerank.log" | tail -2
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods ctkvr ctkvr:rerank_loads_first=1 ctkvr \
        ctkvr:rerank_loads_first=1 kivf kivf:rerank_loads_first=1 --tag _s33rerank 2>&1 \
        | tee "$OUT/gpu_timeline_s33rerank.log" | grep -E "graph|\| rerank |rerank phases"
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --backends triton --methods ctkvr \
        ctkvr:rerank_loads_first=1 ctkvr ctkvr:rerank_loads_first=1 --out "$OUT/s33rerank" 2>&1 \
        | tee "$OUT/gpu_decode_s33rerank.log" | grep -E "graph|Error|error"
      s32_512 s33rerank "ctkvr ctkvr:rerank_loads_first=1 ctkvr" 512 ;;
    s33all)  # needs commit a9b7e0d's kernels (reverted by badd802: `git revert badd802` first).
      # session 33: CTkvr's plan keeping every candidate (k >= probe x rho = 10,240), attended in the rerank:
      # the IVF kernel tests on the GPU, gpu_decode at 128K (B = 1 with the torch planner's agreement, B = 8) and
      # 512K (B = 1) against the default operating point (k = 1024), and with the FIFO update off; a timeline at 128K
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py 2>&1 \
        | tee "$OUT/gpu_tests_s33all.log" | tail -3
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --backends triton --torch-plans --profile \
        --methods ctkvr ctkvr@k=10240 ctkvr@k=10240,fifo=0 --out "$OUT/s33all" 2>&1 \
        | tee "$OUT/gpu_decode_s33all.log" | grep -E "graph|Error|error|agreement"
      s32_512 s33all "ctkvr ctkvr@k=10240 ctkvr@k=10240,fifo=0" 512
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods ctkvr@k=10240 ctkvr@k=10240,fifo=0 ctkvr \
        --tag _s33all 2>&1 | tee "$OUT/gpu_timeline_s33all.log" | grep -E "graph|\| (probe|rerank|select) " ;;
    s33all2)  # needs commit a9b7e0d's kernels (reverted by badd802: `git revert badd802` first).
      # s33all again after the attention's dot was rewritten (q·kᵀ then P·V, M = 16), with the rerank's
      # register cap off / 128 (its 96 spills with the attention) and the FIFO update off
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py -k "keeping_every or fused or graph" \
        2>&1 | tee "$OUT/gpu_tests_s33all2.log" | tail -3
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --backends triton --torch-plans --profile \
        --methods ctkvr ctkvr@k=10240 ctkvr@k=10240:rerank_maxnreg=0 ctkvr@k=10240:rerank_maxnreg=128 \
        ctkvr@k=10240,fifo=0:rerank_maxnreg=0 --out "$OUT/s33all2" 2>&1 \
        | tee "$OUT/gpu_decode_s33all2.log" | grep -E "graph|Error|error|agreement|kernels,"
      s32_512 s33all2 "ctkvr ctkvr@k=10240:rerank_maxnreg=0 ctkvr@k=10240,fifo=0:rerank_maxnreg=0" 512
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods ctkvr@k=10240:rerank_maxnreg=0 ctkvr \
        ctkvr@k=10240,fifo=0:rerank_maxnreg=0 --tag _s33all2 2>&1 | tee "$OUT/gpu_timeline_s33all2.log" \
        | grep -E "graph|\| (probe|rerank|select) |Error" ;;
    s33all3)  # needs commit a9b7e0d's kernels (reverted by badd802: `git revert badd802` first).
      # the plan keeping every candidate in one wave of rerank programs (5 or 4 chunks of 64 slots per
      # program: 264 / 328 programs at 2 per SM, 233 registers) with and without the FIFO push, against the default
      K=ctkvr@k=10240
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 --backends triton --profile --methods ctkvr \
        "$K,fifo=0:rerank_maxnreg=0" "$K,fifo=0:rerank_maxnreg=0,chunks_per_prog=5" \
        "$K,fifo=0:rerank_maxnreg=0,chunks_per_prog=4" "$K:rerank_maxnreg=0,chunks_per_prog=5" ctkvr \
        --out "$OUT/s33all3" 2>&1 | tee "$OUT/gpu_decode_s33all3.log" | grep -E "graph|Error|error|kernels,"
      s32_512 s33all3 "ctkvr $K,fifo=0:rerank_maxnreg=0,chunks_per_prog=5 $K:rerank_maxnreg=0,chunks_per_prog=5" 512
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods "$K,fifo=0:rerank_maxnreg=0,chunks_per_prog=5" \
        "$K:rerank_maxnreg=0,chunks_per_prog=5" --tag _s33all3 2>&1 | tee "$OUT/gpu_timeline_s33all3.log" \
        | grep -E "graph|\| (probe|rerank|select) |Error" ;;
    s33fifo)  # session 33: what CTkvr's FIFO push costs the default step (its select programs run beside the
      # plan's): the default against the update off (fifo=0), alternating, 128K at B = 1 and 8, 512K at B = 1
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --backends triton --profile \
        --methods ctkvr ctkvr@fifo=0 ctkvr ctkvr@fifo=0 --out "$OUT/s33fifo" 2>&1 \
        | tee "$OUT/gpu_decode_s33fifo.log" | grep -E "graph|Error|error|kernels,"
      s32_512 s33fifo "ctkvr ctkvr@fifo=0" 512 ;;
    s33lists)  # session 33: the rerank reading one list per chunk (IvfConfig.rerank_chunk_lists) against the
      # per-slot choice, alternating twice: CTkvr's kernel tests on the GPU, gpu_decode at 128K (B = 1, 8), 512K, timelines
      ivf_ab s33lists "ctkvr:rerank_chunk_lists=0 ctkvr" "ctkvr or probe or one_list" ;;
    s34attn)  # session 34: the attention's launch knobs on CTkvr's 1,024-position plan (9 chunks of 128 rows per KV
      # head: 72 programs of one chunk each at B = 1): 64- and 32-row chunks (144 / 288 programs), 8 warps, 3 stages
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 --profile --methods ctkvr --backends triton \
        triton:block_n=64 triton:block_n=64,num_warps=2 triton:block_n=32 triton:block_n=32,num_warps=2 \
        triton:num_warps=8 triton:num_stages=3 triton --out "$OUT/s34attn" 2>&1 \
        | tee "$OUT/gpu_decode_s34attn.log" | grep -E "graph|Error|error|_split|_merge" ;;
    s34attn2)  # session 34: 64-row chunks over 2 warps (s34attn: the split 7.0 -> 5.8 us for ctkvr) and its neighbours,
      # for ctkvr, psa and saap at 128K, B = 1 and 8 (a default for every method's decode step?)
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --profile --methods ctkvr psa saap --backends \
        triton triton:block_n=64,num_warps=2 triton:num_warps=2 triton:block_n=64,num_warps=1 triton:block_n=32,num_warps=1 \
        triton:block_n=64,num_warps=2,num_stages=3 triton:block_n=64,num_warps=2,num_stages=1 triton --out "$OUT/s34attn2" \
        2>&1 | tee "$OUT/gpu_decode_s34attn2.log" | grep -E "graph|Error|error" ;;
    s34attend)  # session 34: CTkvr's plan attended (IvfConfig.attend) against the split and merge launches after it,
      # alternating twice (ivf_ab). s34attend, s34attend2 and s34diag ran a first version (the attention's programs
      # inside the select's launch, roles by ticket; measured and replaced, RESULTS.md): here they run the tree's
      ivf_ab s34attend "ctkvr:attend=0 ctkvr" "ctkvr or attends or graph" ;;
    s34attend2)  # session 34 (see s34attend): polls paused (nanosleep) and the merge's loads from L2
      # (.cg, not volatile), against attend=0, and its knobs: programs per row, chunk, pause
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py -k "attends or graph" \
        2>&1 | tee "$OUT/gpu_tests_s34attend2.log" | tail -2
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 --backends triton --profile \
        --methods ctkvr:attend=0 ctkvr ctkvr:attend_workers=16 ctkvr:attend_block=128 \
        ctkvr:attend_block=32,attend_workers=32 ctkvr:attend_sleep_ns=0 ctkvr:attend_sleep_ns=1000 ctkvr:attend=0 ctkvr \
        --out "$OUT/s34attend2" 2>&1 | tee "$OUT/gpu_decode_s34attend2.log" | grep -E "graph|Error|error"
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods ctkvr ctkvr:attend_workers=16 ctkvr:attend_block=128 \
        --tag _s34attend2 2>&1 | tee "$OUT/gpu_timeline_s34attend2.log" | grep -vE "^\|---|rerank" ;;
    s34diag)  # session 34 (see s34attend): what slowed the select attending in its own launch (the attention compiled
      # in: 72 KB of shared memory; or the waiting programs): attend_workers=1 (32 programs) against 13 and attend=0
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods ctkvr:attend=0 ctkvr:attend_workers=1 ctkvr \
        ctkvr:attend_workers=4 --tag _s34diag 2>&1 | tee "$OUT/gpu_timeline_s34diag.log" | grep -vE "^\|---|rerank" ;;
    s34pdl)  # session 34: the plan attended by its own launch (_attend_kernel) under PDL, the select compiled without
      # it (s34diag: the attention inside the select launch cost the select's programs ~2 us), against attend=0
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py -k "attends or graph" \
        2>&1 | tee "$OUT/gpu_tests_s34pdl.log" | tail -2
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 --backends triton --profile \
        --methods ctkvr:attend=0 ctkvr ctkvr:attend=0 ctkvr ctkvr:attend_workers=16 ctkvr:attend_pdl=0 \
        --out "$OUT/s34pdl" 2>&1 | tee "$OUT/gpu_decode_s34pdl.log" | grep -E "graph|Error|error"
      s32_512 s34pdl "ctkvr:attend=0 ctkvr ctkvr:attend=0 ctkvr" 512
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods ctkvr:attend=0 ctkvr --tag _s34pdl 2>&1 \
        | tee "$OUT/gpu_timeline_s34pdl.log" | grep -vE "^\|---|rerank" ;;
    s34w16)  # session 34: the attended plan with one 64-position chunk per program (attend_workers=16: 152 programs
      # with the select's) against attend=0, alternating, 128K and 512K
      python3 benchmarks/gpu_decode.py --lengths 131072 524288 --batches 1 --backends triton \
        --methods ctkvr:attend=0 ctkvr:attend_workers=16 ctkvr:attend=0 ctkvr:attend_workers=16 \
        ctkvr:attend_workers=16,attend_sleep_ns=64 --out "$OUT/s34w16" 2>&1 | tee "$OUT/gpu_decode_s34w16.log" \
        | grep -E "graph|Error|error" ;;
    s34final)  # session 34: the attended plan's defaults (a chunk per program, 64 ns polls, the select letting it in
      # after its mass pass) against attend=0, alternating, 128K and 512K; 8 warps, no pause; the tests; timelines
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py -k "attends or graph" \
        2>&1 | tee "$OUT/gpu_tests_s34final.log" | tail -2
      python3 benchmarks/gpu_decode.py --lengths 131072 524288 --batches 1 --backends triton \
        --methods ctkvr:attend=0 ctkvr ctkvr:attend=0 ctkvr ctkvr:attend_warps=8 ctkvr:attend_sleep_ns=0 \
        --out "$OUT/s34final" 2>&1 | tee "$OUT/gpu_decode_s34final.log" | grep -E "graph|Error|error"
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods ctkvr:attend=0 ctkvr --tag _s34final 2>&1 \
        | tee "$OUT/gpu_timeline_s34final.log" | grep -vE "^\|---|rerank" ;;
    s34check)  # session 34: the final tree (the frame's rows from one helper, `_frame_rows`, in the rerank and the
      # attention): the IVF kernel tests of the attended plan and the graph, gpu_decode at 128K and 512K
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py -k "attends or graph or one_list" \
        2>&1 | tee "$OUT/gpu_tests_s34check.log" | tail -2
      python3 benchmarks/gpu_decode.py --lengths 131072 524288 --batches 1 --backends triton \
        --methods ctkvr:attend=0 ctkvr --out "$OUT/s34check" 2>&1 | tee "$OUT/gpu_decode_s34check.log" \
        | grep -E "graph|Error|error" ;;
    s35split)  # session 35: the select split over slices (`IvfConfig.split_select`: `_slices_kernel`, then the search
      # from their counts in a launch of its own) against the one-program select, with 4 warps (2 programs per SM) and
      # slices of 2,048 slots (5 per row) beside the defaults. Measured and dropped: the knob is gone (this first
      # version was never committed; the second, s35split2, is 3bb0e57, reverted by 0a80bda; RESULTS.md session 35)
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py \
        -k "split or graph or attends or ties or sampled" 2>&1 | tee "$OUT/gpu_tests_s35split.log" | tail -2
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --backends triton --profile \
        --methods ctkvr:split_select=0 ctkvr ctkvr:split_warps=4 ctkvr:split_block=2048 ctkvr:split_select=0 ctkvr \
        --out "$OUT/s35split" 2>&1 | tee "$OUT/gpu_decode_s35split.log" | grep -E "graph|Error|error|kernels,"
      s32_512 s35split "ctkvr:split_select=0 ctkvr ctkvr:split_warps=4" 512
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods ctkvr:split_select=0 ctkvr ctkvr:split_warps=4 \
        --tag _s35split 2>&1 | tee "$OUT/gpu_timeline_s35split.log" | grep -vE "^\|---" ;;
    s35split2)  # session 35: the split select with its searches in the slices' launch (`_slices_kernel`: R slice programs
      # and a search program per selection of a row; taken by a request alone in its step) against the one-program
      # select, alternating twice; 4 warps; 512K; timelines
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py \
        -k "split or graph or attends or ties or sampled" 2>&1 | tee "$OUT/gpu_tests_s35split2.log" | tail -2
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --backends triton --profile \
        --methods ctkvr:split_select=0 ctkvr ctkvr:split_warps=4 ctkvr:split_select=0 ctkvr \
        --out "$OUT/s35split2" 2>&1 | tee "$OUT/gpu_decode_s35split2.log" | grep -E "graph|Error|error|kernels,"
      s32_512 s35split2 "ctkvr:split_select=0 ctkvr ctkvr:split_select=0 ctkvr" 512
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods ctkvr:split_select=0 ctkvr ctkvr:split_warps=4 \
        --tag _s35split2 2>&1 | tee "$OUT/gpu_timeline_s35split2.log" | grep -vE "^\|---" ;;
    s35table)  # session 35: the issue-12 table on the final tree: every method (gpu_decode's default list), 32K and 128K,
      # B = 1 and 8, eager and graph, SDPA full and over a 5% slice, with kernel profiles
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --backends triton \
        --out "$OUT/s35table" 2>&1 | tee "$OUT/gpu_decode_s35table.log" | grep -E "^\| |Error|error" ;;
    s35table512)  # session 35: the same at 512K (B = 1); then ctkvr's attention programs over 128 plan positions each
      # (attend_block=128: 8 per row, none beside a select program on its SM) against 64, alternating, 128K and 512K
      python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --backends triton --out "$OUT/s35table512" 2>&1 \
        | tee "$OUT/gpu_decode_s35table512.log" | grep -E "^\| |Error|error"
      python3 benchmarks/gpu_decode.py --lengths 131072 524288 --batches 1 --backends triton \
        --methods ctkvr ctkvr:attend_block=128 ctkvr ctkvr:attend_block=128 --out "$OUT/s35ablock" 2>&1 \
        | tee "$OUT/gpu_decode_s35ablock.log" | grep -E "graph|Error|error" ;;
    s35late)  # session 35: the select letting the attention's launch in after its counting pass (`attend_late`), not
      # after its mass pass: the attended tests on the GPU, then alternating twice at 128K and 512K (B = 1), timelines
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py -k "attends or graph" \
        2>&1 | tee "$OUT/gpu_tests_s35late.log" | tail -2
      python3 benchmarks/gpu_decode.py --lengths 131072 524288 --batches 1 --backends triton \
        --methods ctkvr ctkvr:attend_late=1 ctkvr ctkvr:attend_late=1 --out "$OUT/s35late" 2>&1 \
        | tee "$OUT/gpu_decode_s35late.log" | grep -E "graph|Error|error"
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods ctkvr ctkvr:attend_late=1 --tag _s35late 2>&1 \
        | tee "$OUT/gpu_timeline_s35late.log" | grep -vE "^\|---|rerank" ;;
    s35check)  # session 35: the final tree (`attend_late` on by default): the attended plan's and the graph's IVF tests,
      # gpu_decode of ctkvr at 128K and 512K (B = 1)
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py -k "attends or graph" \
        2>&1 | tee "$OUT/gpu_tests_s35check.log" | tail -2
      python3 benchmarks/gpu_decode.py --lengths 131072 524288 --batches 1 --backends triton --methods ctkvr \
        --out "$OUT/s35check" 2>&1 | tee "$OUT/gpu_decode_s35check.log" | grep -E "graph|Error|error" ;;
    s36budget)  # session 36: psa's rule "budget" (the select writes the plan: crit + select, no sums or stop launch)
      # against the progressive rule, both capped at rho 5%: the PSA kernel tests on the GPU, then gpu_decode at 32K
      # and 128K (B = 1, 8) with profiles, alternating twice (and the plan's stores in chunks of 2,048 once)
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_psa.py 2>&1 \
        | tee "$OUT/gpu_tests_s36psa.log" | tail -2
      P=psa@max_ratio=0.05 B=psa@rule=budget,max_ratio=0.05
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --backends triton --profile \
        --methods $P $B $P $B $B:plan_block=2048 --out "$OUT/s36budget" 2>&1 | tee "$OUT/gpu_decode_s36budget.log" \
        | grep -E "graph|Error|error|kernels," ;;
    s36budget2)  # session 36: the budget plan's stores from a [candidates, block] tile (one load per candidate, not
      # one gather per slot): the same alternation as s36budget without the tests, and 512K (B = 1)
      P=psa@max_ratio=0.05 B=psa@rule=budget,max_ratio=0.05
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --backends triton --profile \
        --methods $P $B $P $B $B:plan_block=2048 --out "$OUT/s36budget2" 2>&1 \
        | tee "$OUT/gpu_decode_s36budget2.log" | grep -E "graph|Error|error|kernels,"
      s32_512 s36budget2 "$P $B $P $B" 512 ;;
    s36pivots)  # session 36: the select's in-register search with four pivots per pass (`select_pivots=4`) against the
      # bisection, psa's two rules at rho 5%, alternating twice, 32K and 128K (B = 1, 8), with profiles; the budget
      # select at 16 warps; then the PSA kernel tests and the attended / graph IVF tests on the GPU (the final tree)
      P=psa@max_ratio=0.05 B=psa@rule=budget,max_ratio=0.05
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --backends triton --profile \
        --methods $B $B:select_pivots=4 $P $P:select_pivots=4 $B $B:select_pivots=4 $B:select_warps=16 \
        --out "$OUT/s36pivots" 2>&1 | tee "$OUT/gpu_decode_s36pivots.log" | grep -E "graph|Error|error|kernels,"
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_psa.py 2>&1 \
        | tee "$OUT/gpu_tests_s36pivots_psa.log" | tail -2
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py -k "attends or graph" \
        2>&1 | tee "$OUT/gpu_tests_s36pivots_ivf.log" | tail -2 ;;
    s36e2e)  # session 36: the 8B model end to end at 128K (random weights), B = 1 and 8: dense, psa capped at rho with
      # its progressive rule, and its budget rule; not planned ahead (psa's auto setting)
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 8 --methods full psa@max_ratio=0.05 \
        psa@rule=budget,max_ratio=0.05 --plan-ahead off --eager-tokens 0 --hf-tokens 0 --tokens 8 --check-prefill 0 \
        --budget-s 420 --out "$OUT/s36e2e" 2>&1 | tee "$OUT/gpu_e2e_s36e2e.log" | grep "^| \|ERROR\|Error" ;;
    s36final)  # session 36, the final tree: the PSA kernel tests on the GPU, then the seed methods and psa's two rules
      # at 32K and 128K, B = 1 and 8 (gpu_decode's default list without streaming, topk and kivf)
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_psa.py 2>&1 \
        | tee "$OUT/gpu_tests_s36final.log" | tail -2
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --backends triton --methods csattn ctkvr \
        lfps psa psa@max_ratio=0.05 psa@rule=budget,max_ratio=0.05 saap --out "$OUT/s36final" 2>&1 \
        | tee "$OUT/gpu_decode_s36final.log" | grep -E "^\| |Error|error" ;;
    s36tl)  # session 36: the timeline of psa's 128K step (its crit and select stamped: the select's phases), both rules
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods psa@rule=budget,max_ratio=0.05 psa@max_ratio=0.05 \
        --tag _s36tl 2>&1 | tee "$OUT/gpu_timeline_s36tl.log" | grep -vE "^\|---" ;;
    s36knobs)  # session 36: after s36tl (crit in two waves, the split's programs 13 us for two chunks): psa's budget
      # rule at 128K, B = 1, with fewer criticality programs (block_b 128) or 8 crit warps, against the split with
      # 4 programs per SM or 64-row chunks
      B=psa@rule=budget,max_ratio=0.05
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 --methods $B $B:block_b=128 $B:crit_warps=8 \
        --backends triton triton:programs_per_sm=4 triton:block_n=64 --out "$OUT/s36knobs" 2>&1 \
        | tee "$OUT/gpu_decode_s36knobs.log" | grep -E "graph|Error|error" ;;
    s36split)  # session 36: the split kernel's pipelining on psa's budget plan at 128K, B = 1 (its programs take 13 us
      # for two 128-row chunks, s36tl): one program per SM, three stages, 256-row chunks in one stage
      B=psa@rule=budget,max_ratio=0.05
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 --methods $B --backends triton \
        triton:programs_per_sm=1 triton:num_stages=3 triton:block_n=256,num_stages=1 triton --out "$OUT/s36split" 2>&1 \
        | tee "$OUT/gpu_decode_s36split.log" | grep -E "graph|Error|error" ;;
    s36acq)  # session 36: ctkvr's attention programs poll the plan's flag with acquire loads whose value the plan's
      # addresses use (`attend_acquire`, removed after this run) against the polls of sessions 34-35: the attended
      # and graph IVF tests,
      # alternating twice at 128K and 512K (B = 1); psa's budget rule at 512K
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py -k "attends or graph" \
        2>&1 | tee "$OUT/gpu_tests_s36acq.log" | tail -2
      python3 benchmarks/gpu_decode.py --lengths 131072 524288 --batches 1 --backends triton \
        --methods ctkvr ctkvr:attend_acquire=0 ctkvr ctkvr:attend_acquire=0 psa@rule=budget,max_ratio=0.05 \
        --out "$OUT/s36acq" 2>&1 | tee "$OUT/gpu_decode_s36acq.log" | grep -E "graph|Error|error" ;;
    s37crit)  # session 37: psa's criticality from one [blocks, 2D] tile of min | max rows (one round trip to memory,
      # not two): the PSA kernel tests on the GPU, then the tree before (.old/psa_head.py) and this one alternating twice,
      # psa's budget rule at 32K and 128K (B = 1, 8) with profiles
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_psa.py 2>&1 \
        | tee "$OUT/gpu_tests_s37crit.log" | tail -2
      old_new s37crit psa@rule=budget,max_ratio=0.05 indexer/kernels/psa.py 2>&1 | tee "$OUT/gpu_decode_s37crit.log" ;;
    s37split)  # session 37: the split kernel under a register cap (255 registers by default with a plan: two programs
      # per SM), with more programs per SM and fewer stages, on psa's budget plan at 128K (B = 1, 8); then timelines
      B=psa@rule=budget,max_ratio=0.05
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --methods $B --backends triton \
        triton:maxnreg=128 triton:maxnreg=168 triton:maxnreg=128,programs_per_sm=3 triton:maxnreg=128,programs_per_sm=4 \
        triton:maxnreg=128,programs_per_sm=4,num_stages=1 triton --out "$OUT/s37split" 2>&1 \
        | tee "$OUT/gpu_decode_s37split.log" | grep -E "graph|Error|error"
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods $B "$B|triton:maxnreg=128" \
        "$B|triton:maxnreg=128,programs_per_sm=4" --tag _s37split 2>&1 | tee "$OUT/gpu_timeline_s37split.log" \
        | grep -vE "^\|---" ;;
    s37attend)  # session 37: psa's budget plan attended by CTkvr's attention launch (ivf._attend_kernel: its programs wait
      # for each row's flag while the select runs; no split or merge launch; `budget_attend*` knobs, removed with the
      # variant after s37late: no faster, benchmarks/RESULTS.md): the PSA kernel tests and the attended /
      # graph IVF tests on the GPU, then gpu_decode against the split + merge (budget_attend=0), alternating twice
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_psa.py 2>&1 \
        | tee "$OUT/gpu_tests_s37attend_psa.log" | tail -2
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_ivf.py -k "attends or graph" \
        2>&1 | tee "$OUT/gpu_tests_s37attend_ivf.log" | tail -2
      B=psa@rule=budget,max_ratio=0.05
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --backends triton \
        --methods $B $B:budget_attend=0 $B $B:budget_attend=0 --out "$OUT/s37attend" 2>&1 \
        | tee "$OUT/gpu_decode_s37attend.log" | grep -E "graph|Error|error" ;;
    s37attend2)  # session 37: the attended budget plan's programs per row at 128K, 512K against the split, a timeline
      # (the variant and its knobs removed after s37late)
      B=psa@rule=budget,max_ratio=0.05
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 --backends triton --methods $B \
        $B:budget_attend_workers=16 $B:budget_attend_workers=52 $B:budget_attend_workers=104 $B --out "$OUT/s37workers" \
        2>&1 | tee "$OUT/gpu_decode_s37workers.log" | grep -E "graph|Error|error"
      s32_512 s37attend2 "$B $B:budget_attend=0 $B" 512
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods $B $B:budget_attend=0 --tag _s37attend 2>&1 \
        | tee "$OUT/gpu_timeline_s37attend.log" | grep -vE "^\|---" ;;
    s37late)  # session 37: the attended budget plan's launch let in after the select's search (budget_attend_late, then
      # the default) against at its start and against the split + merge (budget_attend=0), alternating twice, B = 1; the
      # budget and graph PSA tests on the GPU; a timeline (the variant and its knobs removed after this run)
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_psa.py -k "budget or graph" 2>&1 \
        | tee "$OUT/gpu_tests_s37late.log" | tail -2
      B=psa@rule=budget,max_ratio=0.05
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 --backends triton --methods $B \
        $B:budget_attend_late=0 $B:budget_attend=0 $B $B:budget_attend_late=0 $B:budget_attend=0 --out "$OUT/s37late" \
        2>&1 | tee "$OUT/gpu_decode_s37late.log" | grep -E "graph|Error|error"
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods $B --tag _s37late 2>&1 \
        | tee "$OUT/gpu_timeline_s37late.log" | grep -vE "^\|---" ;;
    s37table)  # session 37, the final tree: the PSA kernel tests on the GPU, then issue 12's table: every method
      # (gpu_decode's default list), 32K and 128K, B = 1 and 8, eager and graph, SDPA full and over a 5% slice, profiles
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_psa.py 2>&1 \
        | tee "$OUT/gpu_tests_s37table.log" | tail -2
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --backends triton \
        --out "$OUT/s37table" 2>&1 | tee "$OUT/gpu_decode_s37table.log" | grep -E "^\| |Error|error" ;;
    s37table512)  # session 37: the same table at 512K (B = 1)
      python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --backends triton --out "$OUT/s37table512" 2>&1 \
        | tee "$OUT/gpu_decode_s37table512.log" | grep -E "^\| |Error|error" ;;
    s37plan)  # session 37: issue 12's first target, the triton backend over a given random 5% plan against SDPA over a
      # contiguous 5% slice (gpu_decode's triton_plan_5pct rows), B = 1, 32K-512K, with the frame-only method
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 524288 --batches 1 --backends triton --methods streaming \
        --out "$OUT/s37plan" 2>&1 | tee "$OUT/gpu_decode_s37plan.log" | grep -E "given|sdpa|Error|error" ;;
    s38blocks)  # session 38: psa's budget rule over coarser blocks (64 and 128 tokens: 1/2 and 1/4 of the metadata the
      # crit reads, of the keys the select ranks), the crit's blocks per program at 128-token blocks; the PSA budget and
      # graph kernel tests first; then the timelines at 128K (their quality: benchmarks/RESULTS_psa_lfps.md)
      P=psa@rule=budget,max_ratio=0.05
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_psa.py -k "budget or graph" 2>&1 \
        | tee "$OUT/gpu_tests_s38blocks.log" | tail -2
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --backends triton --methods $P \
        $P,block_size=64 $P,block_size=128 $P,block_size=128:block_b=32 $P,block_size=128:block_b=16 \
        --out "$OUT/s38blocks" 2>&1 | tee "$OUT/gpu_decode_s38blocks.log" | grep -E "graph|Error|error"
      python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --backends triton --methods $P $P,block_size=64 \
        $P,block_size=128 --out "$OUT/s38blocks512" 2>&1 | tee "$OUT/gpu_decode_s38blocks512.log" \
        | grep -E "graph|Error|error"
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods $P $P,block_size=128 --tag _s38blocks 2>&1 \
        | tee "$OUT/gpu_timeline_s38blocks.log" | grep -vE "^\|---" ;;
    s38plan)  # session 38: the budget select reads its candidates back before the plan's other stores and stores no
      # keys (against .old/psa_head.py, alternating twice, blocks of 32 and 128), then the split without the plan's
      # lengths (`triton:plan_lengths=0`: one dependent load less; budget plans are 98-100% filled) and two launch
      # knobs with it, at 128K; the kernel tests first (both changes and the knob removed: no faster, RESULTS.md)
      P=psa@rule=budget,max_ratio=0.05
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_psa.py tests/test_triton_attention.py \
        -k "budget or graph or lengths" 2>&1 | tee "$OUT/gpu_tests_s38plan.log" | tail -2
      old_new s38plan "$P $P,block_size=128" indexer/kernels/psa.py 2>&1 | tee "$OUT/gpu_decode_s38plan.log"
      python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --methods $P,block_size=128 $P --backends triton \
        triton:plan_lengths=0 triton triton:plan_lengths=0 triton:plan_lengths=0,programs_per_sm=4 \
        triton:plan_lengths=0,block_n=64 --out "$OUT/s38len" 2>&1 | tee "$OUT/gpu_decode_s38len.log" \
        | grep -E "graph|Error|error"
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods "$P,block_size=128|triton:plan_lengths=0" \
        --tag _s38plan 2>&1 | tee "$OUT/gpu_timeline_s38plan.log" | grep -vE "^\|---" ;;
    s38fused)  # session 38: psa's budget rule selected and attended in one launch (`_budget_attend_kernel`: every
      # program finds its row's K best blocks itself and attends its share; the merge after) against the select + split +
      # merge path (`:budget_attend=0`), with its chunks per program and warps, blocks of 32, 64 and 128; the PSA kernel
      # tests first; timelines at 128K (the kernel and its knobs: commit 54b8058, reverted by 3ad0c8c, slower)
      P=psa@rule=budget,max_ratio=0.05
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_psa.py \
        -k "budget or graph or attend or selects" 2>&1 | tee "$OUT/gpu_tests_s38fused.log" | tail -2
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --backends triton --methods \
        $P,block_size=128 $P,block_size=128:budget_attend=0 $P,block_size=128:budget_attend_chunks=1 \
        $P,block_size=128:budget_attend_chunks=4 $P,block_size=128:budget_attend_warps=8 $P,block_size=128 \
        $P,block_size=128:budget_attend=0 $P $P:budget_attend=0 $P,block_size=64 --out "$OUT/s38fused" 2>&1 \
        | tee "$OUT/gpu_decode_s38fused.log" | grep -E "graph|Error|error"
      python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --backends triton --methods $P,block_size=128 \
        $P,block_size=128:budget_attend_blocks=4096,budget_attend_warps=8 --out "$OUT/s38fused512" 2>&1 \
        | tee "$OUT/gpu_decode_s38fused512.log" | grep -E "graph|Error|error"
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods $P,block_size=128 $P,block_size=128:budget_attend=0 \
        --tag _s38fused 2>&1 | tee "$OUT/gpu_timeline_s38fused.log" | grep -vE "^\|---" ;;
    s38parts)  # session 38: the budget select's plan stores shared by select_parts programs per row (each finds the same
      # threshold), 1 / 2 / 4 / 8, blocks of 128 and 32, alternating; the PSA budget tests first; timelines at 128K
      # (`PsaConfig.select_parts`, removed with the variant: no faster, benchmarks/RESULTS.md)
      P=psa@rule=budget,max_ratio=0.05
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_psa.py -k "budget or graph" 2>&1 \
        | tee "$OUT/gpu_tests_s38parts.log" | tail -2
      B=$P,block_size=128
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --backends triton --methods $B \
        $B:select_parts=2 $B:select_parts=4 $B:select_parts=8 $B $B:select_parts=4 $B:select_parts=8 $P \
        $P:select_parts=4 $P $P:select_parts=4 --out "$OUT/s38parts" 2>&1 | tee "$OUT/gpu_decode_s38parts.log" \
        | grep -E "graph|Error|error"
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods $B $B:select_parts=4 $B:select_parts=8 \
        --tag _s38parts 2>&1 | tee "$OUT/gpu_timeline_s38parts.log" | grep -vE "^\|---" ;;
    s38e2e)  # session 38: the 8B model end to end at 128K (random weights), B = 1 and 8: dense and psa's budget rule over
      # blocks of 32 and 128 tokens (s36e2e's protocol)
      P=psa@rule=budget,max_ratio=0.05
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 8 --methods full $P $P,block_size=128 \
        --plan-ahead off --eager-tokens 0 --hf-tokens 0 --tokens 8 --check-prefill 0 --budget-s 420 \
        --out "$OUT/s38e2e" 2>&1 | tee "$OUT/gpu_e2e_s38e2e.log" | grep "^| \|ERROR\|Error" ;;
    s39ids)  # session 39: psa's budget plan as a block list (the select stores one id per block, no plan tile; the
      # split expands the ids) against the tree before (.old/tree: `git archive e882850 benchmarks decoder indexer storage
      # tests`), alternating twice, blocks of 32 and 128, with the select's search in 8 and 16 parts per step
      # (`search_ways`); the PSA and attention kernel tests first
      P=psa@rule=budget,max_ratio=0.05
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_psa.py tests/test_triton_attention.py \
        -k "budget or graph or search or block_lists or lengths" 2>&1 | tee "$OUT/gpu_tests_s39ids.log" | tail -2
      rm -rf /tmp/old && cp -r .old/tree /tmp/old || exit 1
      for i in 1 2; do
        (cd /tmp/old && python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --backends triton \
          --methods $P,block_size=128 $P --out "$OUT/s39ids_old$i" 2>&1 | grep "graph" | grep -v sdpa)
        python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --backends triton --methods \
          $P,block_size=128 $P,block_size=128:search_ways=8 $P,block_size=128:search_ways=16 $P \
          --out "$OUT/s39ids_new$i" 2>&1 | grep -E "graph|Error|error" | grep -v sdpa
      done 2>&1 | tee "$OUT/gpu_decode_s39ids.log" ;;
    s39more)  # session 39: the block-list plan at 512K (B = 1) and the timeline at 128K, blocks of 128
      P=psa@rule=budget,max_ratio=0.05
      python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --backends triton --methods $P,block_size=128 \
        $P --out "$OUT/s39more512" 2>&1 | tee "$OUT/gpu_decode_s39more512.log" | grep -E "graph|Error|error"
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods $P,block_size=128 --tag _s39more 2>&1 \
        | tee "$OUT/gpu_timeline_s39more.log" | grep -vE "^\|---" ;;
    s39pre)  # session 39: psa's crit loads its metadata tile before the wait for the previous kernel (PDL), against the
      # tree before (.old/tree: `git archive 06e912f ...`); the PSA kernel tests first (as run then: the tests also
      # selected "attend", and the 512K row took this tree over blocks of 128 and 32, not the tree before)
      tree_ab s39pre tests/test_kernels_psa.py "budget or graph or equals_torch or attend" ;;
    s39e2e)  # session 39: the 8B model end to end at 128K (random weights), B = 1 and 8, with psa's budget plan as a
      # block list: dense and the budget rule over blocks of 32 and 128 tokens (s38e2e's protocol)
      P=psa@rule=budget,max_ratio=0.05
      python3 benchmarks/gpu_e2e.py --lengths 131072 --batches 1 8 --methods full $P $P,block_size=128 \
        --plan-ahead off --eager-tokens 0 --hf-tokens 0 --tokens 8 --check-prefill 0 --budget-s 420 \
        --out "$OUT/s39e2e" 2>&1 | tee "$OUT/gpu_e2e_s39e2e.log" | grep "^| \|ERROR\|Error" ;;
    s39merge)  # session 39: the split's last program per query block merges the splits' states (a ticket; no merge
      # launch) against the merge launch (`triton:merge_last=0`), twice, psa's budget rule over blocks of 128 and 32,
      # saap and csattn; the attention and PSA kernel tests first; then the timeline at 128K
      P=psa@rule=budget,max_ratio=0.05
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_triton_attention.py tests/test_kernels_psa.py \
        -k "last_split or bypass or lengths or graph or block_lists or budget or poisoned" 2>&1 \
        | tee "$OUT/gpu_tests_s39merge.log" | tail -2
      for i in 1 2; do
        python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --backends triton triton:merge_last=0 \
          --methods $P,block_size=128 $P saap csattn --out "$OUT/s39merge$i" 2>&1 | grep -E "Error|error"
      done 2>&1 | tee "$OUT/gpu_decode_s39merge.log"
      python3 benchmarks/gpu_timeline.py --lengths 131072 --methods $P,block_size=128 --tag _s39merge 2>&1 \
        | tee "$OUT/gpu_timeline_s39merge.log" | grep -vE "^\|---" ;;
    s39final)  # session 39: the block-list budget plan, three runs at 32K and 128K (B = 1 and 8), blocks of 128 with the
      # select on 4 warps (`select_warps=4`) next to it, and blocks of 32; then 512K
      P=psa@rule=budget,max_ratio=0.05
      for i in 1 2 3; do
        python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --backends triton --methods \
          $P,block_size=128 $P,block_size=128:select_warps=4 $P --out "$OUT/s39final$i" 2>&1 | grep -E "Error|error"
      done 2>&1 | tee "$OUT/gpu_decode_s39final.log"
      python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --backends triton --methods $P,block_size=128 \
        --out "$OUT/s39final512" 2>&1 | tee "$OUT/gpu_decode_s39final512.log" | grep -E "graph|Error|error" ;;
    s39knobs)  # session 39: the crit of the block-list budget step over blocks of 128 on 8 or 2 warps (`psa:crit_warps`,
      # default 4), twice (the split on 8 warps or 3 stages was not run: aot_sass.py puts one program per SM)
      P=psa@rule=budget,max_ratio=0.05,block_size=128
      for i in 1 2; do
        python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --backends triton \
          --methods $P $P:crit_warps=8 $P:crit_warps=2 --out "$OUT/s39knobs$i" 2>&1 | grep -E "Error|error"
      done ;;
    s40knobs)  # session 40: the split kernel's launch knobs at the block-list budget step over blocks of 128 (128K):
      # one chunk per program (programs_per_sm 3, 4), one program per SM with two K/V buffers (num_stages 3),
      # register loads (num_stages 1), 64-row chunks with one per program; twice
      P=psa@rule=budget,max_ratio=0.05,block_size=128
      for i in 1 2; do
        python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --methods $P --backends triton \
          triton:programs_per_sm=4 triton:programs_per_sm=3 triton:num_stages=3,programs_per_sm=1 \
          triton:num_stages=1 triton:block_n=64,programs_per_sm=4 --out "$OUT/s40knobs$i" 2>&1 \
          | grep -E "Error|error"
      done ;;
    s40pf)  # session 40: the split kernel's chunk loop as a software pipeline in registers (`triton:prefetch=1`: chunk
      # c + 1's rows loaded while chunk c is attended; the knob removed after this run) against the default, twice; the
      # attention kernel tests first
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_triton_attention.py 2>&1 \
        | tee "$OUT/gpu_tests_s40pf.log" | tail -2
      P=psa@rule=budget,max_ratio=0.05,block_size=128
      for i in 1 2; do
        python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --methods $P csattn saap --backends \
          triton triton:prefetch=1 triton:prefetch=1,block_n=64 triton:prefetch=1,num_warps=8 \
          --out "$OUT/s40pf$i" 2>&1 | grep -E "Error|error"
      done ;;
    s40early)  # session 40: psa's crit issues q's and the positions' loads with its metadata tile's, the select loads its
      # row's criticality with the tiles' states (dropped after this run); against the tree before (.old/tree:
      # `git archive 14a9204 ...`); the PSA kernel tests first (this run had no 512K row of the tree before)
      tree_ab s40early tests/test_kernels_psa.py "budget or graph or equals_torch" ;;
    s40crit)  # session 40: psa's crit alone issues q's and the positions' loads with its metadata tile's (the select as
      # before); against the tree before (.old/tree: `git archive 14a9204 ...`); the PSA kernel tests first
      tree_ab s40crit tests/test_kernels_psa.py "budget or graph or equals_torch" ;;
    s40len)  # session 40: the split kernel without a block list's lengths (`triton:block_lengths=0`: the splits share the
      # list's width, no program waits for the lengths; the knob removed after this run), and 3 K/V buffers in one
      # program per SM, against the default; twice; then 512K
      P=psa@rule=budget,max_ratio=0.05
      for i in 1 2; do
        python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --methods $P,block_size=128 $P \
          --backends triton triton:block_lengths=0 triton:num_stages=4,programs_per_sm=1 --out "$OUT/s40len$i" 2>&1 \
          | grep -E "Error|error"
      done
      python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --backends triton triton:block_lengths=0 \
        --methods $P,block_size=128 --out "$OUT/s40len512" 2>&1 | grep -E "Error|error" ;;
    s40merge)  # session 40: the merge kernel's tile follows the split count (32 for 28 splits) against this tree with the
      # fixed tile of 64 (.old/tree: the working tree with `merge_tile` returning 64; the tile code removed after this
      # run); the attention tests of the merge and of block lists first (this run had no 512K row of the tree before)
      tree_ab s40merge tests/test_triton_attention.py "merge_tiles or block_lists" ;;
    s40final)  # session 40: the final tree: the PSA kernel tests and the attention tests of block lists and of more splits
      # than one merge chunk on the GPU, then psa's budget step at 32K and 128K, B = 1 and 8
      P=psa@rule=budget,max_ratio=0.05
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_psa.py tests/test_triton_attention.py \
        -k "budget or graph or equals_torch or merge_chunk or block_lists" 2>&1 | tee "$OUT/gpu_tests_s40final.log" \
        | tail -2
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --backends triton --methods \
        $P,block_size=128 --out "$OUT/s40final" 2>&1 | grep -E "Error|error" ;;
    split_tma)  # the TMA probe (benchmarks/gpu_split_tma.py, written in session 40, not yet run on a GPU): psa's block-list
      # attention with whole-block TMA loads against frame_attention, over rows per chunk, stages, warps and programs
      # per SM, at 128K and 512K
      python3 benchmarks/gpu_split_tma.py --out "$OUT" 2>&1 | tee "$OUT/gpu_split_tma.log" | grep -E "us|Error|error" ;;
    s41table)  # session 41, the final tree: issue 12's table (every method of gpu_decode's default list, 32K and 128K,
      # B = 1 and 8, eager and graph, SDPA full and over a 5% slice, the given-plan rows, profiles, builds against the
      # prefill, the fused planners against their torch path) with psa's center and mean criticality over blocks of 128
      P=psa@rule=budget,max_ratio=0.05,block_size=128
      python3 benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8 --profile --torch-plans --backends triton \
        --methods streaming topk csattn ctkvr kivf lfps psa psa@rule=budget,max_ratio=0.05 $P $P,criticality=center \
        $P,criticality=mean saap --out "$OUT/s41table" 2>&1 | tee "$OUT/gpu_decode_s41table.log" \
        | grep -E "^\| |Error|error" ;;
    s41table512)  # session 41: the same table at 512K, B = 1 (gpu_decode's default list)
      python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --backends triton --out "$OUT/s41table512" 2>&1 \
        | tee "$OUT/gpu_decode_s41table512.log" | grep -E "^\| |Error|error" ;;
    s41repeat)  # session 41: psa's budget step over blocks of 128 at 128K, B = 1, cuboid and mean criticality, three runs
      P=psa@rule=budget,max_ratio=0.05,block_size=128
      for i in 1 2 3; do
        python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 --backends triton --methods $P $P,criticality=mean \
          --out "$OUT/s41repeat$i" 2>&1 | grep -E "Error|error"
      done 2>&1 | tee "$OUT/gpu_decode_s41repeat.log" ;;
    s41mean)  # session 41: psa's budget over blocks of 128 with the cuboid and the mean criticality at 512K (B = 1) and
      # 128K (B = 1 and 8), twice
      P=psa@rule=budget,max_ratio=0.05,block_size=128
      for i in 1 2; do
        python3 benchmarks/gpu_decode.py --lengths 524288 --batches 1 --backends triton --methods $P $P,criticality=mean \
          --out "$OUT/s41mean512_$i" 2>&1 | grep -E "Error|error"
        python3 benchmarks/gpu_decode.py --lengths 131072 --batches 1 8 --backends triton --methods $P \
          $P,criticality=mean --out "$OUT/s41mean_$i" 2>&1 | grep -E "Error|error"
      done 2>&1 | tee "$OUT/gpu_decode_s41mean.log" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
# The device tool returns at most 8 files from $OUT (README of the tool, "Limits"); past that it drops some,
# and twice a session's JSON rows were lost that way. So the JSON files go into one tarball, then, if
# still more than 8 files remain, everything does.
if [ -n "$BUNDLE" ] && [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  (cd "$OUT" && find . -type f -name '*.json' -print0 | tar -czf json.tar.gz --null -T - --remove-files)
  if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
    tar -czf /tmp/device_out.tar.gz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/device_out.tar.gz "$OUT/all.tar.gz"
  fi
  ls -la "$OUT"
fi
