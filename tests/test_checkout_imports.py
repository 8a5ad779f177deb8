"""A source checkout imports as the installed package does: run from the clone's root after a non-editable
`pip install .`, the clone's overlap_tp/ comes first on sys.path and shadows the installed copy, whose kernels/,
megatron_patches/ and launch/ live inside it (setup.py's package_dir); in the checkout they sit beside it."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# an editable install (CI's) maps the three names with a finder of its own: taken out, the interpreter sees what a
# checkout with a non-editable install (or none) gives
PROGRAM = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
sys.path_hooks[:] = [h for h in sys.path_hooks if "__editable__" not in getattr(h, "__module__", "")]
sys.path_importer_cache.clear()
import overlap_tp
import overlap_tp.kernels.signaled_gemm, overlap_tp.megatron_patches, overlap_tp.launch
for name in ("kernels.signaled_gemm", "megatron_patches", "launch"):
    print(sys.modules["overlap_tp." + name].__file__)
print(overlap_tp.__file__)
"""


def test_the_checkout_imports_its_folders_as_subpackages():
    done = subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    files = done.stdout.split()
    assert files == [os.path.join(ROOT, "kernels", "signaled_gemm.py"),
                     os.path.join(ROOT, "megatron_patches", "__init__.py"),
                     os.path.join(ROOT, "launch", "__init__.py"),
                     os.path.join(ROOT, "overlap_tp", "__init__.py")], done.stdout
