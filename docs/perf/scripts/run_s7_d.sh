# Session 7, call 4 (nvidia-h200): the norm backward's hand-written one-row prefetch (e485eb5) against
# Triton's loop pipeliner on the un-prefetched loop (tl.range num_stages 2 / 3 / 4; .diag/stages), same run.
source .diag/setup_device.sh
export OVERLAP_TP_GIT_COMMIT=${COMMIT:-unknown}
W=/tmp/w7d; mkdir -p $W
pack() { cd $W && tar czf $OUT/s7_d.tgz . ; }
trap pack EXIT
timeout 120 python3 -m overlap_tp.bench norm --out $W --name norm_prefetch > $W/norm_prefetch.log 2>&1; echo "prefetch exit $?"
KFILE=$(python3 -c "import overlap_tp.kernels.fused_add_rmsnorm as m; print(m.__file__)")
cp $REPO/.diag/stages/fused_add_rmsnorm.py $KFILE
for st in 2 3 4; do
  NORM_STAGES=$st timeout 120 python3 -m overlap_tp.bench norm --out $W --name norm_stages$st > $W/norm_stages$st.log 2>&1; echo "stages $st exit $?"
done
for f in norm_prefetch norm_stages2 norm_stages3 norm_stages4; do echo "== $f"; grep "bwd fused |\|bwd fused, map |" $W/$f.md | cut -d'|' -f2-8; done
