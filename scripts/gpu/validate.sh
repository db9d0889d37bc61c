#!/usr/bin/env bash
# Real-GPU checks of the simulation, run on one CUDA GPU from the repository root:
#   bash scripts/gpu/validate.sh OUT_DIR PHASE...
# PHASE: env | kernels | varlen | docs64 | mem128 | time64 | mem256 | wrappers | segments | emu128 | emulong | emu16 | emuskip
#        | emurope | emuranks | emudocs
# (any order, several at once). $DEVICE: the device preset the rows name (default h100-80g; h200-141g on an H200).
# Every trial is `python -m bench run --mode real` at world size 1 of the 4-block Llama3-8B
# (scripts/gpu/llama3-8b-4l.yaml) with expandable segments, as the paper's runs set, except
# phases emu128, emulong and emu16: `--mode emulated`, the whole Llama3-8B (emu16: $EMU_MODEL) as rank 0 of 8 or 16
# (a fake process group: real kernels and allocator, collectives return at once; a method whose ranks differ,
# such as a ring, is emulated on each of its deciding ranks in turn, unless CPAB_SIM_RANKS=0), the shapes
# of the paper's short-context anchors; with $SEGMENTS_OUT set they also write the allocator's
# segments per stream there (scripts/gpu/snap/sitecustomize.py); rows go
# to OUT_DIR/real.jsonl, each trial's output to OUT_DIR/log.txt. A trial that fails is logged
# and the next one runs. scripts/gpu/compare.py sets the same trials beside their simulation.
set -u
out=${1:?usage: validate.sh OUT_DIR PHASE...}; shift
mkdir -p "$out"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
model=scripts/gpu/llama3-8b-4l.yaml
if [ -n "${SEGMENTS_OUT:-}" ]; then mkdir -p "$SEGMENTS_OUT"; fi

trial() {  # trial TIMEOUT_S ARGS...: one real trial, its output appended to the log
  local limit=$1; shift
  echo "=== $(date +%T) $*" | tee -a "$out/log.txt"
  # the trial's output goes to the log; an emulated trial's progress by rank (stderr) to the console too
  timeout "$limit" $py -m bench run --mode "${MODE:-real}" --device "${DEVICE:-h100-80g}" --world-size "${WS:-1}" --model "${MODEL:-$model}" \
      --json --out "$out/real.jsonl" "$@" 2>&1 | tee -a "$out/log.txt" | grep --line-buffered '^\[emulated\] rank'
  echo "--- rc=${PIPESTATUS[0]} $(date +%T)" | tee -a "$out/log.txt"
  tail -n 1 "$out/real.jsonl" 2>/dev/null | $py -c '
import json, sys
r = json.loads(sys.stdin.read() or "{}"); f = r.get("figures") or {}
gib = lambda b: "%.2f" % ((b or 0) / 2**30)
print("   last row:", r.get("method"), r.get("seq_len"), r.get("status"), "allocated", gib(f.get("peak_bytes")),
      "reserved", gib(f.get("peak_reserved_bytes")), "GiB; step", f.get("step_time_s"), (r.get("message") or "")[:300])
if f.get("rank_peaks"):
    reserved = dict(map(tuple, f.get("rank_reserved_peaks") or []))
    print("   worst rank", f.get("worst_rank"), "of ranks (allocated/reserved GiB):",
          ", ".join("%d: %s/%s" % (k, gib(v), gib(reserved.get(k))) for k, v in f["rank_peaks"]))'
}

emu_trial() {  # emu_trial WS MODEL TAG TIMEOUT_S ARGS...: an emulated trial (rank 0 of WS), segments tagged TAG
  local ws=$1 emu_model=$2 tag=$3; shift 3
  MODE=emulated WS=$ws MODEL=$emu_model SEGMENTS_TAG="$tag" \
    PYTHONPATH="${SEGMENTS_OUT:+scripts/gpu/snap}${PYTHONPATH:+:$PYTHONPATH}" trial "$@"
}

for phase in "$@"; do
  case $phase in
    env)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$out/log.txt"
      $py -c 'import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())' \
        | tee -a "$out/log.txt" ;;
    kernels)
      timeout 240 $py scripts/gpu/kernels.py --out "$out/kernels.ndjson" 2>&1 | tee -a "$out/log.txt" ;;
    varlen)  # the attention kernel's variable-length path under documents: checked, then timed by document length
      timeout 240 $py scripts/gpu/varlen.py --out "$out/varlen.ndjson" 2>&1 | tee -a "$out/log.txt" ;;
    docs64)  # packed documents (a prolong64k draw) against one sequence, Ulysses and UPipe: memory and
      # step time, 5 timed steps after 1 untimed
      for m in ulysses upipe; do for docs in "" "--docs prolong64k"; do
        trial 150 --method $m --seq-len 64K --warmup 1 --iters 5 $docs
      done; done ;;
    mem128)  # memory: one steady-state step after the first (reset_peak_memory_stats in between)
      for m in ulysses upipe; do trial 200 --method $m --seq-len 128K --warmup 1 --iters 1 --smoke; done ;;
    time64)  # step time with spread: 5 timed steps after 2 untimed
      for m in ulysses upipe; do trial 200 --method $m --seq-len 64K --warmup 2 --iters 5; done ;;
    mem256)
      for m in ulysses upipe; do trial 300 --method $m --seq-len 256K --warmup 1 --iters 1 --smoke; done ;;
    wrappers)  # the CUDA code paths of the other methods and of the library wrappers
      for m in fpdt torch-cp offload ds-ulysses; do trial 200 --method $m --seq-len 128K --warmup 1 --iters 1 --smoke; done ;;
    segments)  # per-stream segments at the end of the timed step (scripts/gpu/snap/sitecustomize.py);
      # $SEG_METHODS (default: ulysses upipe fpdt) at $SEG_LEN (default 128K); the committed 256K
      # segments: SEG_METHODS="ulysses upipe" SEG_LEN=256K
      mkdir -p "$out/segments"
      len=${SEG_LEN:-128K}
      for m in ${SEG_METHODS:-ulysses upipe fpdt}; do
        SEGMENTS_OUT="$out/segments" SEGMENTS_TAG="$m $len" PYTHONPATH="scripts/gpu/snap${PYTHONPATH:+:$PYTHONPATH}" \
          trial 300 --method $m --seq-len "$len" --warmup 1 --iters 1 --smoke
      done ;;
    emu128)  # the 128K anchor (docs/paper.md): Llama3-8B, 32 blocks, rank 0 of 8, paper levers;
      # segments per stream too when SEGMENTS_OUT is set (the segments phase's hook)
      for m in ulysses upipe; do
        emu_trial 8 llama3-8b "$m 128K ws8" 420 --method $m --seq-len 128K --warmup 1 --iters 5
      done ;;
    emulong)  # the same at longer lengths, memory only (one step after the first): $EMU_LENS
      # (default 256K), $EMU_METHODS (default ulysses upipe)
      for len in ${EMU_LENS:-256K}; do for m in ${EMU_METHODS:-ulysses upipe}; do
        emu_trial 8 llama3-8b "$m $len ws8" 560 --method $m --seq-len "$len" --warmup 1 --iters 1 --smoke
      done; done ;;
    emu16)  # Fig. 5's UPipe points: our usp-upipe (Ulysses degree 8 x ring 2), rank 0 of 16,
      # memory only, at $EMU_LENS (default 512K), of $EMU_MODEL (default llama3-8b; qwen3-32b at
      # 128K is the other 128K anchor)
      for len in ${EMU_LENS:-512K}; do
        emu_trial 16 "${EMU_MODEL:-llama3-8b}" "usp-upipe $len ws16 ${EMU_MODEL:-llama3-8b}" 560 \
          --method usp-upipe --opt ulysses_degree=8 --seq-len "$len" --warmup 1 --iters 1 --smoke
      done ;;
    emuskip)  # the paper's long-context memory points, emulated with the attention arithmetic skipped
      # (--attention-math skip, bench.measure.skipmath: the kernels' real outputs and scratch, no
      # FLOPs), memory only. First the wrapper paths on the 4-block model at 128K (yunchang with the
      # memory-faithful FA3; our ulysses with torch's flash ops), stopping there unless both answered
      # forward and backward calls; then Fig. 5's 4M point (USP and UPipe, rank 0 of 16, all 32
      # blocks), Table 3's Ulysses 4M boundary on 8 ranks with the 4-block model (the fidelity
      # extrapolates from 3- and 4-block simulations; all 32 blocks' host copies would need 124 GiB
      # of pinned host memory, which the lent machine lacks), and yunchang's Ulysses at 2M on 8 ranks
      # with all 32 blocks. RoPE angles computed per block (--rope-table none): TorchTitan's
      # whole-sequence table, offloaded with every block, would double the host copies.
      skip="--attention-math skip --offload-keep first --rope-table none --warmup 1 --iters 1 --smoke"
      emu_trial 8 "$model" "yc-usp 128K ws8 4l skip" 90 --method yc-usp --opt attn_type=fa3 --opt ulysses_degree=8 \
        --seq-len 128K $skip
      emu_trial 8 "$model" "ulysses 128K ws8 4l skip" 90 --method ulysses --seq-len 128K $skip
      if [ "$(grep -c '_backward x\|bwd x' "$out/real.jsonl" 2>/dev/null)" -lt 2 ]; then
        echo "emuskip: a 128K trial answered no backward call: the long trials would compute for real; stopping"
        continue
      fi
      emu_trial 16 llama3-8b "yc-usp 4M ws16 skip" 200 --method yc-usp --opt attn_type=fa3 --opt ulysses_degree=8 \
        --seq-len 4M --ring-barrier $skip
      emu_trial 16 llama3-8b "usp-upipe 4M ws16 skip" 200 --method usp-upipe --opt ulysses_degree=8 \
        --seq-len 4M --ring-barrier $skip
      emu_trial 8 "$model" "yc-usp 4M ws8 4l skip" 120 --method yc-usp --opt attn_type=fa3 --opt ulysses_degree=8 \
        --seq-len 4M $skip
      emu_trial 8 llama3-8b "yc-usp 2M ws8 skip" 200 --method yc-usp --opt attn_type=fa3 --opt ulysses_degree=8 \
        --seq-len 2M $skip ;;
    emurope)  # the paper stack's TorchTitan RoPE table (--rope-table checkpointed: the whole sequence's
      # angles on every rank, stored with each block's checkpoint), real, at Fig. 5's 4M point on 16
      # ranks and Fig. 1's 3M point on 8, with the 4-block model (its host copies fit the machine;
      # the fidelity command extrapolates from 3- and 4-block simulations), attention arithmetic skipped
      rope="--attention-math skip --offload-keep first --rope-table checkpointed --warmup 1 --iters 1 --smoke"
      emu_trial 16 "$model" "yc-usp 4M ws16 4l rope" 90 --method yc-usp --opt attn_type=fa3 --opt ulysses_degree=8 \
        --seq-len 4M --ring-barrier $rope
      emu_trial 16 "$model" "usp-upipe 4M ws16 4l rope" 90 --method usp-upipe --opt ulysses_degree=8 \
        --seq-len 4M --ring-barrier $rope
      emu_trial 8 "$model" "yc-usp 3M ws8 4l rope" 90 --method yc-usp --opt attn_type=fa3 --opt ulysses_degree=8 \
        --seq-len 3M $rope
      emu_trial 8 "$model" "upipe 3M ws8 4l rope" 90 --method upipe --seq-len 3M $rope ;;
    emuranks)  # does the simulation get a rank other than 0 right? Emulated on every deciding rank in turn
      # (bench.measure.run._emulated; CPAB_SIM_RANKS must not be 0), the attention arithmetic skipped, the
      # 4-block model at 1M tokens on 8 ranks: our zigzag `ring` (of the zigzag rings, the one whose simulation
      # puts the most between rank 0 and its worst rank: 26.94 against 31.94 GiB reserved under the paper stack
      # on h200-141g; yunchang's and ring-flash-attn's 28.44 against 28.93), Ulysses as the symmetric control
      # (one rank), then the ring with a prolong64k draw (seed 0). $EMURANKS_MODEL and $EMURANKS_LEN (default
      # the 4-block model, 1M) shrink it for a dry run on a CPU (DEVICE=cpu EMURANKS_MODEL=tiny-mha EMURANKS_LEN=1K
      # OMP_NUM_THREADS=1). The caps (190 + 50 + 150 s) fit one device call of 400 s; a ring killed at its cap
      # writes no row, but each rank's peaks are on the console and in the log as it finishes
      if [ "${CPAB_SIM_RANKS:-deciding}" != deciding ]; then
        echo "emuranks: CPAB_SIM_RANKS=$CPAB_SIM_RANKS would measure one rank; unset it"; exit 2
      fi
      ranks="--attention-math skip --offload-keep first --rope-table none --warmup 1 --iters 1 --smoke"
      len=${EMURANKS_LEN:-1M} emodel=${EMURANKS_MODEL:-$model}
      emu_trial 8 "$emodel" "ring $len ws8 4l ranks" 190 --method ring --seq-len "$len" $ranks
      emu_trial 8 "$emodel" "ulysses $len ws8 4l ranks" 50 --method ulysses --seq-len "$len" $ranks
      emu_trial 8 "$emodel" "ring $len ws8 4l ranks docs" 150 --method ring --seq-len "$len" --docs prolong64k:0 $ranks ;;
    emudocs)  # the packed ring under documents on CUDA: our `ring` in `doc-zigzag` (its sections: every varlen call
      # on slices, merged in place; methods/core/ringpack.py) and in the global zigzag, a prolong64k draw
      # (seed 0), each emulated on every deciding rank in turn with the attention computed (real varlen kernels,
      # real allocator), the 4-block model at 256K on 8 ranks; $EMURANKS_MODEL and $EMURANKS_LEN as emuranks
      # (a CPU dry run takes the per-pair calls: the torch kernel has no varlen form there). Caps: 2 x 200 s
      if [ "${CPAB_SIM_RANKS:-deciding}" != deciding ]; then
        echo "emudocs: CPAB_SIM_RANKS=$CPAB_SIM_RANKS would measure one rank; unset it"; exit 2
      fi
      docs="--docs prolong64k:0 --offload-keep first --rope-table none --warmup 1 --iters 1 --smoke"
      len=${EMURANKS_LEN:-256K} emodel=${EMURANKS_MODEL:-$model}
      emu_trial 8 "$emodel" "ring doc-zigzag $len ws8 4l docs" 200 --method ring --opt layout=doc-zigzag \
        --seq-len "$len" $docs
      emu_trial 8 "$emodel" "ring zigzag $len ws8 4l docs" 200 --method ring --seq-len "$len" $docs ;;
    *) echo "unknown phase $phase (env kernels varlen docs64 mem128 time64 mem256 wrappers segments emu128 emulong emu16 emuskip emurope emuranks emudocs)"; exit 2 ;;
  esac
done
