# Session 9, call 7 (nvidia-h200): the gemm benchmark after the event_times refactor, short (8B, full grid, 2 rounds).
export PYTHONUNBUFFERED=1 OVERLAP_TP_GIT_COMMIT=${COMMIT:-unknown}
python3 -m pip install --no-deps --no-build-isolation . -q 2>&1 | grep -v -i warning | tail -2
cd /tmp; timeout 120 python3 -m overlap_tp.bench gemm --layers l8b --comm-sms 0 --rounds 2 --out $OUT --name gemm_check 2>&1 | tail -3
