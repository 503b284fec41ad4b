#!/usr/bin/env bash
# The GPU runs of issue 18 item 2 (MiniLM's encoder trained by the protocol) and issue 20 item 2 (FedES and
# FedGD on MNIST), as run on a lent H100, all processes sharing the GPU at once:
#   bash benchmarks/encoder_gpu.sh WALL_MINUTES        (writes into $OUT)
# It reads a folder .gpu/ (git-ignored) prepared on a machine with the package registry: .gpu/whl (wheels of
# datasets, evaluate, dill, multiprocess for the GPU machine's Python), .gpu/data/{sst2,trec} and .gpu/mnist
# (copies of ../shared/data's files), .gpu/minilm (all-MiniLM-L6-v2 with its weights stored as float16, loaded as
# float32: the transfer to the lent machine is limited to 64 MiB) and .gpu/probes (the zeroth-order probes, made
# on the CPU with `MINILM_PATH=.gpu/minilm python benchmarks/encoder.py --task T --attack A --probe_dir .gpu/probes
# --probe_only`). LOCAL=1 runs the same processes on this machine's CPU without the set-up (a dry run).
set -u
WALL=${1:-7}
cd "$(dirname "$0")/.."
if [ -z "${LOCAL:-}" ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/env.txt"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl
  export PYTHONPATH=/tmp/site
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/tmp/pip.txt 2>&1 || ln -s ../tasks zo_byzantine/task_specs
  python3 -c "import torch, transformers, datasets, evaluate, peft; print(torch.__version__, transformers.__version__, datasets.__version__, peft.__version__)" >> "$OUT/env.txt" 2>&1 || { cat "$OUT/env.txt"; exit 3; }
  python3 -c "from zo_byzantine.tasks import load_task; load_task('sst2')" >> "$OUT/env.txt" 2>&1 || { cat "$OUT/env.txt" /tmp/pip.txt; exit 4; }
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false MINILM_PATH=.gpu/minilm PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
start=$(date +%s)
LIMIT=$(python3 -c "print(int(60 * $WALL + 90))")
mkdir -p /tmp/gpu_runs
enc() {  # name task attack lr [more encoder.py arguments]
  local name=$1 task=$2 attack=$3 lr=$4; shift 4
  timeout "$LIMIT" python3 benchmarks/encoder.py --task "$task" --attack "$attack" --lr "$lr" --wall_minutes "$WALL" \
    --data .gpu/data --probe_dir .gpu/probes --out "/tmp/gpu_runs/enc_$name.json" "$@" > "/tmp/gpu_runs/enc_$name.log" 2>&1 &
}
fed() {  # name method n_B [more fedes.py arguments]
  local name=$1 method=$2 nb=$3; shift 3
  timeout "$LIMIT" python3 benchmarks/fedes.py --method "$method" --n_B "$nb" --wall_minutes "$WALL" --data .gpu/mnist \
    --runs_dir "/tmp/gpu_runs/fed_$name" "$@" > "/tmp/gpu_runs/fed_$name.log" 2>&1 &
}
enc trec_none trec none 5e-5
enc trec_alie trec alie 5e-5
enc trec_sf trec sf 5e-5
enc trec_none_lora trec none 1e-3 --trainable lora
enc sst2_none sst2 none 2e-5
enc sst2_alie sst2 alie 2e-5
enc sst2_sf sst2 sf 2e-5
enc sst2_none_lora sst2 none 1e-3 --trainable lora
enc sst2_none_nu4 sst2 none 8e-5 --nu 4
fed fedes_iid_64 fedes 64 --split iid --budget_gb "${BUDGET:-16}"
fed fedes_iid_1024 fedes 1024 --split iid --budget_gb "${BUDGET:-16}"
fed fedgd_iid fedgd 64 --split iid
wait
python3 - <<'PY'
import glob, json, os
out = {}
for path in sorted(glob.glob("/tmp/gpu_runs/*.json")):  # encoder.py --out
    out[os.path.basename(path)[:-5]] = json.load(open(path))
for path in sorted(glob.glob("/tmp/gpu_runs/fed_*/*.json")):  # fedes.py --runs_dir (checkpoints left on the machine)
    out[os.path.basename(os.path.dirname(path))] = json.load(open(path))
json.dump(out, open(os.path.join(os.environ["OUT"], "gpu_runs.json"), "w"))
with open(os.path.join(os.environ["OUT"], "logs.txt"), "w") as f:
    for path in sorted(glob.glob("/tmp/gpu_runs/*.log")):
        lines = [l for l in open(path).read().splitlines()
                 if l.strip() and "examples/s" not in l and "it/s" not in l and "Warning" not in l]
        f.write(f"== {path}\n" + "\n".join(lines[-40:]) + "\n")
for name, r in out.items():
    print(name, r.get("start"), r.get("best", r.get("max")), r["final"], r["rounds"], round(r["ms_per_round"], 1))
PY
echo "total $(( $(date +%s) - start )) s"
