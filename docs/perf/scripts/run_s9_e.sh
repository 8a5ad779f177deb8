export PYTHONUNBUFFERED=1
python3 -m pip install --no-deps --no-build-isolation . -q 2>&1 | grep -v -i warning | tail -2
REPO=$PWD; cd /tmp
timeout 400 python3 $REPO/.diag/gemm_experiment.py 2>&1 | tee $OUT/gemm_experiment.log
