#!/usr/bin/env bash
# One pass on a GPU machine, most important first: the CUDA tests of the device paths, where a step's data time
# goes (bench.gpu.stages), then whole Ray jobs against the ceiling per --feature-placement/--sample-on
# (bench.gpu.placements: arxiv structure with its consoles kept, then the products-shaped graph), then bench.gpu.
# docs/performance.md#gpu has the figures. Usage, from the repository root with gnnray's dependencies importable:
#   bash bench/gpu_run.sh OUT_DIR [ARXIV_STRUCTURE_DIR]
# OUT_DIR gets log.txt (everything printed), tests.txt, consoles.txt (each job's whole console) and the JSON
# results. The lent GPU machines lack Ray: carry ../shared/tools/gpu-wheels.sh's .whl/ and install it first.
set -uo pipefail
out=${1:?usage: bench/gpu_run.sh OUT_DIR [ARXIV_STRUCTURE_DIR]}
arxiv=${2:-../shared/datasets/arxiv-structure}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OUTDATED_IGNORE=1
log="$out/log.txt"
step() { echo "=== $(date +%T) $*" | tee -a "$log"; }
py=${PYTHON:-python3}

step stack
$py -c "import sys, torch, numpy, numba, ray, triton; print(sys.version.split()[0], 'torch', torch.__version__,
'numpy', numpy.__version__, 'numba', numba.__version__, 'ray', ray.__version__, 'triton', triton.__version__,
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA')" 2>&1 | tee -a "$log"
nproc | tee -a "$log"

step CUDA tests
timeout ${TESTS_S:-120} $py -m pytest -q -p no:cacheprovider -x tests/train/test_placement.py \
  tests/train/test_prefetch.py tests/train/test_step.py tests/train/test_captured.py tests/train/test_process_group.py \
  "tests/train/test_device_sampler.py::test_device_batches_follow_the_seed_plan_with_their_features" \
  > "$out/tests.txt" 2>&1
tail -4 "$out/tests.txt" | tee -a "$log"

step stages at products shape
timeout ${STAGES_S:-150} $py -m bench.gpu.stages --json "$out/stages.json" 2>&1 | tee -a "$log"

consoles=$(mktemp -d)
step jobs on arxiv structure
timeout ${ARXIV_S:-240} $py -m bench.gpu.placements --arxiv "$arxiv" --only arxiv-structure --epochs 5 \
  --rows ${ARXIV_ROWS:-auto/auto device/device host/actors} --job-timeout ${ARXIV_JOB_S:-90} --console "$consoles" \
  --json "$out/placements-arxiv.json" 2>&1 | tee -a "$log"

step jobs on the products-shaped graph
timeout ${PRODUCTS_S:-300} $py -m bench.gpu.placements --only products-shaped --epochs 4 \
  --rows ${PRODUCTS_ROWS:-auto/auto device/device} --job-timeout ${PRODUCTS_JOB_S:-140} --console "$consoles" \
  --json "$out/placements-products.json" 2>&1 | tee -a "$log"
for f in "$consoles"/*.txt; do echo "##### $(basename "$f")"; cat "$f"; done > "$out/consoles.txt" 2>/dev/null

if [ -n "${BENCH_GPU:-}" ]; then
  step bench.gpu
  timeout 150 $py -m bench.gpu --json "$out/gpu.json" 2>&1 | tail -40 | tee -a "$log"
fi
step done
