#!/bin/bash
# usage: bash gpu_job.sh STEP...   (temporary; not committed)
exec > >(tee -a $OUT/log.txt) 2>&1
set -x
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch,triton;print(torch.__version__,triton.__version__,torch.backends.cudnn.version())"
mkdir -p /tmp/o
extract() {  # RUN NAME
python - "$1" "$2" <<'PY'
import json,sqlite3,sys
run,name=sys.argv[1:]
db=sqlite3.connect(run+'/run.sqlite')
rows=[]
for pid,it,res in db.execute('select id,iteration,result_json from programs order by created_at'):
    r=json.loads(res) if res else {}
    rows.append(dict(id=pid,iteration=it,stage_s=r.get('stage_s'),fitness=r.get('fitness'),verdict=r.get('verdict'),
        duration_s=r.get('duration_s'),timing_s=[c.get('timing_s') for c in r.get('configs') or []]))
json.dump(rows,open('/tmp/o/'+name+'_programs.json','w'),indent=1)
PY
}
for step in "$@"; do
case $step in
order) python benchmarks/round_order.py --repeats 1 --out /tmp/o/order.json ;;
run3) sed -i 's/^SPARES = [0-9]/SPARES = 3/' evoattn/sandbox.py; grep -n '^SPARES' evoattn/sandbox.py
      evoattn run --config configs/default.yaml --seed 4 --max-wall-s 200 --quiet --output /tmp/run3 > /tmp/o/run3.txt 2>&1; tail -25 /tmp/o/run3.txt; extract /tmp/run3 run3 ;;
run2) sed -i 's/^SPARES = [0-9]/SPARES = 2/' evoattn/sandbox.py; grep -n '^SPARES' evoattn/sandbox.py
      evoattn run --config configs/default.yaml --seed 4 --max-wall-s 200 --quiet --output /tmp/run2 > /tmp/o/run2.txt 2>&1; tail -25 /tmp/o/run2.txt; extract /tmp/run2 run2
      sed -i 's/^SPARES = [0-9]/SPARES = 3/' evoattn/sandbox.py ;;
noise) sed -i 's/^SPARES = [0-9]/SPARES = 3/' evoattn/sandbox.py
      python benchmarks/noise.py seeds/sdpa/flash_hybrid.py --standalone 0 --in-run 5 --out /tmp/o/noise.json 2>&1 | tail -30 ;;
diag) python benchmarks/noise.py seeds/sdpa/flash_hybrid.py --standalone 4 --in-run 5 --out /tmp/o/diag.json 2>&1 | tail -12 ;;
run) evoattn run --config configs/default.yaml --seed 4 --max-wall-s 200 --quiet --output /tmp/runf > /tmp/o/runf.txt 2>&1; tail -22 /tmp/o/runf.txt; extract /tmp/runf runf ;;
proto) timeout 150 python benchmarks/protocol_check.py --stages pinned --out /tmp/o/protocol.json 2>&1 | tail -25 ;;
esac
done
cd /tmp && tar czf $OUT/o.tgz o
