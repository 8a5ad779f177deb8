#!/usr/bin/env bash
# Transformer Engine on a device machine, from what te_pack.py put in .te/. Run from the repository root.
# Installs TE into $TE_SITE (default /tmp/te-site; add it to PYTHONPATH) and prints the import check.
#   - The core library and TE's python code: unpacked from .te/te-core-sm90.tar.xz (no build).
#   - The PyTorch extension: taken from .te/torch-ext/ (the wheel a previous build returned, in 15 MiB pieces
#     named transformer_engine_torch-*.whl.part-*) when present; else built from .te/build/ (the source
#     distribution and the cuDNN frontend's headers) against this machine's torch (sm_90, 16 jobs) and, when $OUT
#     is set, returned there in pieces for .te/torch-ext/.
# carry: [".te"] to build; once .te/torch-ext/ holds the build, [".te/wheels", ".te/torch-ext",
# ".te/te-core-sm90.tar.xz", ".te/transformer_engine-2.20.2-py3-none-any.whl"] (without the build inputs).
# Prints the build time and the wheel's size.
set -euo pipefail
REPO=$PWD
TE_SITE=${TE_SITE:-/tmp/te-site}
rm -rf "$TE_SITE"; mkdir -p "$TE_SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$TE_SITE" .te/wheels/*.whl .te/transformer_engine-*.whl
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='tar')" .te/te-core-sm90.tar.xz "$TE_SITE"
export PYTHONPATH=$TE_SITE${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".te/torch-ext/transformer_engine_torch-*.whl.part-*" > /dev/null; then
  wheel=/tmp/$(basename "$(ls .te/torch-ext/*.part-* | head -1)" | sed 's/\.part-.*//')
  cat .te/torch-ext/*.part-* > "$wheel"
  echo "PyTorch extension: the kept build $(basename "$wheel") ($(du -m "$wheel" | cut -f1) MiB)"
else
  src=/tmp/te-torch-src; rm -rf "$src" /tmp/te-wheel; mkdir -p "$src" /tmp/te-wheel
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$TE_SITE" .te/build/nvidia_cudnn_frontend-*.whl
  tar xzf .te/build/transformer_engine_torch-*.tar.gz -C "$src" --strip-components=1
  t0=$SECONDS
  (cd "$src" && NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS=90 NVTE_WITH_NCCL_EP=0 MAX_JOBS=${MAX_JOBS:-16} \
     python3 -m pip wheel -q --no-deps --no-build-isolation -w /tmp/te-wheel . 2>&1 | { grep -v -i warn || true; } \
     | tail -20)   # a quiet, successful build prints nothing: grep's "no line" is no failure (pipefail)
  wheel=$(ls /tmp/te-wheel/transformer_engine_torch-*.whl)
  echo "PyTorch extension built in $((SECONDS - t0)) s: $(basename "$wheel") ($(du -m "$wheel" | cut -f1) MiB)"
  if [[ -n ${OUT:-} ]]; then split -b 15M -d "$wheel" "$OUT/$(basename "$wheel").part-"; fi
fi
python3 -m pip install -q --no-index --no-deps --no-compile --target "$TE_SITE" "$wheel"
cd /tmp && python3 - <<'PY'
import torch, transformer_engine, transformer_engine.pytorch as te
print("transformer_engine", transformer_engine.__version__, "torch", torch.__version__, torch.cuda.get_device_name())
layer = te.Linear(1024, 1024, params_dtype=torch.bfloat16).cuda()
x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
ref = x.float() @ layer.weight.float().t() + layer.bias.float()
err = ((layer(x).float() - ref).norm() / ref.norm()).item()
print(f"te.Linear bf16: rel err {err:.2e}")
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Float8BlockScaling
for recipe in (DelayedScaling(), Float8CurrentScaling(), Float8BlockScaling()):
    try:
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
            y = layer(x)
        err = ((y.float() - ref).norm() / ref.norm()).item()
        print(f"te.Linear fp8 {type(recipe).__name__}: rel err {err:.2e}")
    except Exception as e:  # a recipe this TE/card does not run: say so, do not stop
        print(f"te.Linear fp8 {type(recipe).__name__}: {type(e).__name__}: {str(e)[:200]}")
PY
