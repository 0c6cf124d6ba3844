M=$1; R=$2
for r in $(seq 1 $R); do
  PYTHONPATH=/work/wt_old /work/main/.venv/bin/python /work/wt_old/benchmarks/threads_default.py $M --rounds 1 --skip-offline --configs default 2>&1 | grep "^round" | sed 's/^/OLD /'
  PYTHONPATH=/work/main /work/main/.venv/bin/python /work/main/benchmarks/threads_default.py $M --rounds 1 --skip-offline --configs default,2 2>&1 | grep "^round" | sed 's/^/NEW /'
done
