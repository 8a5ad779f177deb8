# sourced by the run scripts: environment, carried wheels, the package installed, cwd /tmp
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OVERLAP_TP_WATCHDOG_S=30
REPO=$PWD
rm -rf /tmp/site; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | grep -v -i warn | tail -2
export PYTHONPATH=/tmp/site
python3 -m pip install --no-deps --no-build-isolation . -q 2>&1 | grep -v -i warning | tail -2
cd /tmp
