#!/usr/bin/env bash
# One pass on a GPU machine, most important first: whole Ray jobs training on the GPU (one train worker fed by 1, 2,
# 4 and 8 sampler actors; a synthetic graph with learnable embeddings), then the CUDA tests, bench.gpu and the
# sampler's speed on this machine's cores. docs/performance.md#gpu has
# the figures. Usage, from the repository root with gnnray's dependencies importable:
#   bash bench/gpu_run.sh OUT_DIR [ARXIV_STRUCTURE_DIR]
# USE_GPU=no rehearses it on a CPU. The lent GPU machines lack Ray: carry ../shared/tools/gpu-wheels.sh's .whl/ and install it first.
set -uo pipefail
out=${1:?usage: bench/gpu_run.sh OUT_DIR [ARXIV_STRUCTURE_DIR]}
arxiv=${2:-../shared/datasets/arxiv-structure}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OUTDATED_IGNORE=1
log="$out/log.txt"
step() { echo "=== $(date +%T) $*" | tee -a "$log"; }
py=${PYTHON:-python3}

step stack
$py -c "import sys, torch, numpy, numba, ray; print(sys.version.split()[0], 'torch', torch.__version__, 'numpy',
numpy.__version__, 'numba', numba.__version__, 'ray', ray.__version__, 'cuda', torch.cuda.is_available(),
torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" 2>&1 | tee -a "$log"
nproc | tee -a "$log"

runs=$(mktemp -d)  # checkpoints stay out of OUT_DIR: only the summary (jobs.json) and the log go there
job() {  # name, then options
  local name=$1; shift
  step "job $name: $*"
  timeout 100 $py jobs/train_arxiv.py --use-gpu "${USE_GPU:-yes}" --storage-path "$runs" --name "$name" "$@" 2>&1 \
    | grep -v "^(" | tail -12 | tee -a "$log"
}
arxiv_job=(--dataset "$arxiv" --random-features 128 --fanouts 10,10,10 --batch-size 1024 --hidden 256
           --num-workers 1 --epochs 4 --eval sampled)
for actors in 1 2 4 8; do
  job "arxiv-actors-$actors" "${arxiv_job[@]}" --sampler-actors "$actors,$actors"
done
job synthetic-embedding --dataset synthetic --synthetic-nodes 200000 --embedding-dim 32 --num-workers 1 \
  --sampler-actors 4,4 --epochs 3 --eval sampled

step summary
$py - "$runs" > "$out/jobs.json" <<'PY'
import json, os, statistics, sys
runs = sys.argv[1]
out = {}
for name in sorted(os.listdir(runs)) if os.path.isdir(runs) else []:
    path = os.path.join(runs, name, "metrics.jsonl")
    if not os.path.exists(path):
        continue
    rows = [json.loads(line) for line in open(path)]
    steady = rows[1:] or rows
    out[name] = dict(epochs=len(rows), epoch_time=[r["epoch_time"] for r in rows],
                     data_wait=[r["data_wait"] for r in rows], seeds_per_s=[r["seeds_per_s"] for r in rows],
                     steady_epoch_time=statistics.median(r["epoch_time"] for r in steady),
                     steady_data_wait=statistics.median(r["data_wait"] for r in steady),
                     val_acc=rows[-1].get("val_acc"), last=rows[-1])
print(json.dumps(out, indent=1))
PY
cat "$out/jobs.json" | $py -c "import json,sys; d=json.load(sys.stdin); [print(k, 'steady epoch', round(v['steady_epoch_time'],2), 's, data_wait', v['steady_data_wait'], ', val_acc', v['val_acc']) for k,v in d.items()]" | tee -a "$log"
step CUDA tests
timeout 150 $py -m pytest -q -p no:cacheprovider tests/pipeline/test_prefetch.py tests/train/test_step.py \
  tests/test_torch_only.py tests/test_gpu_bench.py tests/pipeline/test_pick.py 2>&1 | tail -25 | tee -a "$log"

step bench.gpu
timeout 150 $py -m bench.gpu --json "$out/gpu.json" 2>&1 | tail -60 | tee -a "$log"

step sampling on this machine, one thread per batch
timeout 90 $py -m bench.sampling --dataset "$arxiv" --no-products --threads 1 --batches 40 \
  --json "$out/sampling.json" 2>&1 | tail -5 | tee -a "$log"

step done
