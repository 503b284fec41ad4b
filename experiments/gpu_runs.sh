#!/usr/bin/env bash
# The runs made on lent H100s, every process of a set sharing the GPU at once:
#   bash experiments/gpu_runs.sh SET WALL_MINUTES        (writes into $OUT)
# SET encoder: issue 18 item 2 (MiniLM's encoder trained by the protocol) and issue 20 item 2 (FedES and FedGD),
#   as run on 2026-11-27 (second run); fedes: issue 20 item 2 (FedES, per-client directions stacked), as run on
#   2026-11-27 (third run), after the CUDA-only tests; draws: the CUDA-only tests and `benchmarks/launches.py` timed
#   on the GPU (a FedES round's draws one at a time against together; not yet run).
# It reads a folder .gpu/ (git-ignored) prepared on a machine with the package registry: .gpu/whl (wheels of
# datasets, evaluate, dill, multiprocess for the GPU machine's Python), .gpu/data/{sst2,trec} and .gpu/mnist
# (copies of ../shared/data's files), for encoder .gpu/minilm (all-MiniLM-L6-v2 with its weights stored as float16,
# loaded as float32: the transfer to the lent machine is limited to 64 MiB) and .gpu/probes (the zeroth-order
# probes, made on the CPU with `MINILM_PATH=.gpu/minilm python experiments/real_model/encoder.py --task T --attack A
# --probe_dir .gpu/probes --probe_only`), for fedes .gpu/fedes_runs (earlier legs: <run>.json and
# tmp/<run>/checkpoint-N, resumed; each run's checkpoints come back as $OUT/<run>.tar.gz). LOCAL=1 runs the same
# processes on this machine's CPU without the set-up (a dry run).
set -u
SET=${1:?SET: encoder, fedes or draws}
WALL=${2:-7}
case "$SET" in encoder|fedes|draws) ;; *) echo "SET=$SET; accepted: encoder, fedes, draws" >&2; exit 2;; esac
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
LIMIT=$(python3 -c "print(int(60 * $WALL + 45))")
RUNS=/tmp/gpu_runs
mkdir -p "$RUNS/fedes"
enc() {  # name task attack lr [more encoder.py arguments]
  local name=$1 task=$2 attack=$3 lr=$4; shift 4
  timeout "$LIMIT" python3 experiments/real_model/encoder.py --task "$task" --attack "$attack" --lr "$lr" \
    --wall_minutes "$WALL" --data .gpu/data --probe_dir .gpu/probes --out "$RUNS/enc_$name.json" "$@" \
    > "$RUNS/enc_$name.log" 2>&1 &
}
fed() {  # name method n_B [more fedes.py arguments]; runs in $RUNS/fedes (one JSON per run, checkpoints in tmp/)
  local name=$1 method=$2 nb=$3; shift 3
  [ "$method" = fedes ] && set -- --n_B "$nb" "$@"  # FedGD has no n_B (its clients' whole data)
  timeout "$LIMIT" python3 experiments/fedes/fedes.py --method "$method" --wall_minutes "$WALL" --data .gpu/mnist \
    --runs_dir "$RUNS/fedes" "$@" > "$RUNS/fed_$name.log" 2>&1 &
}
if [ "$SET" = draws ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -k cuda tests/test_directions.py tests/test_update_path.py
  for nu in 24 94; do timeout 120 python3 benchmarks/launches.py --nu "$nu" --time_clients 10 --device cuda; done
  exit 0
fi
if [ "$SET" = encoder ]; then
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
else
  cp -r .gpu/fedes_runs/. "$RUNS/fedes/"
  if [ -z "${LOCAL:-}" ]; then  # the CUDA-only tests first, beside the runs
    timeout 240 python3 -m pytest -q -p no:cacheprovider -k cuda tests/test_directions.py tests/test_update_path.py \
      > "$OUT/cuda_tests.txt" 2>&1 &
  fi
  fed iid_256 fedes 256 --split iid --budget_gb "${BUDGET:-12}"
  fed iid_64 fedes 64 --split iid --budget_gb "${BUDGET:-12}"
  fed dirichlet_64 fedes 64 --split dirichlet --budget_gb "${BUDGET:-12}"
  fed dirichlet_256 fedes 256 --split dirichlet --budget_gb "${BUDGET:-12}"
fi
sleep 90; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv 2>/dev/null; tail -n 3 "$RUNS"/*.log
wait
for run in "$RUNS"/fedes/tmp/*/; do  # each run's newest checkpoint, to resume elsewhere
  name=$(basename "$run"); newest=$(ls -d "$run"checkpoint-* 2>/dev/null | sort -t- -k2 -n | tail -1)
  [ -n "$newest" ] && tar -czf "${OUT:-/tmp}/$name.tar.gz" -C "$RUNS/fedes/tmp" "$name/$(basename "$newest")"
done
python3 - <<'PY'
import glob, json, os
out = {}
for path in sorted(glob.glob("/tmp/gpu_runs/*.json")):  # encoder.py --out
    out[os.path.basename(path)[:-5]] = json.load(open(path))
for path in sorted(glob.glob("/tmp/gpu_runs/fedes/*.json")):  # fedes.py --runs_dir
    out[os.path.basename(path)[:-5]] = json.load(open(path))
target = os.environ.get("OUT", "/tmp")
json.dump(out, open(os.path.join(target, "gpu_runs.json"), "w"))
with open(os.path.join(target, "logs.txt"), "w") as f:
    for path in sorted(glob.glob("/tmp/gpu_runs/*.log")):
        lines = [l for l in open(path).read().splitlines()
                 if l.strip() and "examples/s" not in l and "it/s" not in l and "Warning" not in l]
        f.write(f"== {path}\n" + "\n".join(lines[-40:]) + "\n")
for name, r in out.items():
    print(name, r.get("start"), r.get("best", r.get("max")), r["final"], r["rounds"], round(r["ms_per_round"], 1))
PY
echo "total $(( $(date +%s) - start )) s"
