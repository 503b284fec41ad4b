#!/usr/bin/env bash
# The GPU run of issue 18 item 2 (and the CUDA tests of tests/test_directions.py), as run on a lent H100:
#   bash benchmarks/encoder_gpu.sh WALL_MINUTES        (writes into $OUT)
# It reads a folder .gpu/ (git-ignored) prepared on a machine with the package registry: .gpu/whl (wheels of
# datasets, evaluate, dill, multiprocess for the GPU machine's Python), .gpu/data/{sst2,trec} (copies of
# ../shared/data's files) and .gpu/minilm (all-MiniLM-L6-v2 with its weights stored as float16, loaded as
# float32: the transfer to the lent machine is limited to 64 MiB). Eight runs share the GPU at once.
set -u
WALL=${1:-6.5}
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/env.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/tmp/pip.txt 2>&1 || ln -s ../tasks zo_byzantine/task_specs
python3 -c "import torch, transformers, datasets, evaluate, peft; print(torch.__version__, transformers.__version__, datasets.__version__, peft.__version__)" >> "$OUT/env.txt" 2>&1 || { cat "$OUT/env.txt"; exit 3; }
python3 -c "from zo_byzantine.tasks import load_task; load_task('sst2')" >> "$OUT/env.txt" 2>&1 || { cat "$OUT/env.txt" /tmp/pip.txt; exit 4; }
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false MINILM_PATH=.gpu/minilm PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
start=$(date +%s)
timeout 120 python3 -m pytest tests/test_directions.py -p no:cacheprovider -q -rs > "$OUT/cuda_tests.txt" 2>&1
echo "tests: rc $? in $(( $(date +%s) - start )) s" >> "$OUT/cuda_tests.txt"
mkdir -p /tmp/enc
run() {  # name task attack lr
  python3 benchmarks/encoder.py --task "$2" --attack "$3" --lr "$4" --wall_minutes "$WALL" --data .gpu/data \
    --out "/tmp/enc/$1.json" > "/tmp/enc/$1.log" 2>&1 &
}
run sst2_none_2e-5 sst2 none 2e-5
run sst2_none_5e-5 sst2 none 5e-5
run sst2_none_1e-4 sst2 none 1e-4
run sst2_alie sst2 alie 5e-5
run sst2_sf sst2 sf 5e-5
run trec_none trec none 5e-5
run trec_alie trec alie 5e-5
run trec_sf trec sf 5e-5
wait
python3 - <<'PY'
import glob, json, os
out = {}
for path in sorted(glob.glob("/tmp/enc/*.json")):
    out[os.path.basename(path)[:-5]] = json.load(open(path))
json.dump(out, open(os.path.join(os.environ["OUT"], "encoder_gpu.json"), "w"))
with open(os.path.join(os.environ["OUT"], "logs.txt"), "w") as f:
    for path in sorted(glob.glob("/tmp/enc/*.log")):
        lines = [l for l in open(path).read().splitlines()
                 if l.strip() and not l.startswith("{") and "examples/s" not in l and "it/s" not in l]
        f.write(f"== {path}\n" + "\n".join(lines[-25:]) + "\n")
for name, r in out.items():
    print(name, r["start"], r["best"], r["final"], r["rounds"], round(r["ms_per_round"], 1))
PY
echo "total $(( $(date +%s) - start )) s"
