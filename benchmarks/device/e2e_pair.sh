# End to end, overlap off against on: COMMIT=<sha> [ON=signal] [ROUNDS=2] [LIMIT=300] [SKIP=4]
#   bash benchmarks/device/e2e_pair.sh RECIPE [VAR=VALUE ...] [-- MEGATRON FLAGS]
# recipes/RECIPE.sh with OVERLAP=off and OVERLAP=$ON, ROUNDS rounds in alternating order (off first in odd rounds),
# the recipe's knobs as VAR=VALUE (e.g. TP=4 NPROC=4 MBS=2 GBS=8 TRAIN_ITERS=12 LOG_INTERVAL=1). Each round's
# train.log pair goes to $OUT/logs/ and its speedup is printed as overlap-tp-report computes it (medians after the
# first SKIP logged intervals); a results row that cites a pair keeps it in benchmarks/logs/.
source "$(dirname "$0")/setup.sh"
recipe=$1; shift
vars=(); while (( $# )) && [[ $1 != -- ]]; do vars+=("$1"); shift; done; (( $# )) && shift
workdir "e2e_$recipe"; mkdir -p "$OUT/logs"
for ((i = 1; i <= ${ROUNDS:-2}; i++)); do
  order="off on"; (( i % 2 == 0 )) && order="on off"
  for side in $order; do
    mode=off; [[ $side == on ]] && mode=${ON:-signal}
    train "$recipe-$side-$i" "${LIMIT:-300}" "${vars[@]}" OVERLAP=$mode -- "$REPO/recipes/$recipe.sh" "$@"
    cp "$W/$recipe-$side-$i/train.log" "$OUT/logs/$recipe-$side-$i.train.log"
  done
  python3 - "$OUT/logs/$recipe-off-$i.train.log" "$OUT/logs/$recipe-on-$i.train.log" "${SKIP:-4}" <<'PY'
import sys
from overlap_tp.training import report
runs = [report.load(path) for path in sys.argv[1:3]]
for row in report.summary_rows(runs, int(sys.argv[3])):
    print(f"{row['label']}: {row['step_time_ms']:.1f} ms/iteration, on/off {row['speedup']:.3f}")
PY
done
