"""overlap_tp: Megatron TP/SP linear layers whose GEMMs signal per group of tiles so that each
group's collective starts while the rest of the GEMM still runs.

Public ops (the contract other parts and outside benchmarks call):
    gemm_rs(a, w, group=None, *, bias=None, config=None, async_op=False)  -> reduce_scatter(a @ w.T) [+ bias]
    gemm_ar(a, w, group=None, *, bias=None, config=None, async_op=False)  -> all_reduce(a @ w.T) [+ bias]
        (async_op=True: a Pending whose wait() joins the communication and returns the result)
    ag_gemm(a_shard, w, group=None, *, bias=None, config=None, return_gathered=False)
                                                           -> all_gather(a_shard) @ w.T [+ bias]
    a2a_gemm(x, counts, w, group=None, *, config=None, return_received=False)
                                                           -> MoE dispatch (all-to-all) + grouped fc1 GEMM
    gemm_a2a(h, counts, w, group=None, *, config=None)     -> grouped fc2 GEMM + MoE combine (all-to-all)
    OverlapConfig                                          how they run (method, schedule, groups, ...)
"""
import importlib.abc
import importlib.util
import os
import sys


class _CheckoutFolders(importlib.abc.MetaPathFinder):
    """Imports overlap_tp.kernels, .megatron_patches and .launch from a source checkout's top-level folders.

    setup.py installs those folders as subpackages of overlap_tp (package_dir). Where Python finds this package in a
    checkout instead of the installed copy (a script or pytest run from the clone's root after a non-editable
    `pip install .`: the working directory comes first on sys.path), the folders sit beside the package, not in it;
    this finder maps the three names onto them, so the checkout imports exactly as the installed package does. Their
    own submodules then load from the package's __path__ as usual. An editable install maps the same names to the
    same folders."""

    FOLDERS = {"overlap_tp.kernels": "kernels", "overlap_tp.megatron_patches": "megatron_patches",
               "overlap_tp.launch": "launch"}

    def __init__(self, root: str):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        folder = self.FOLDERS.get(fullname)
        if folder is None:
            return None
        location = os.path.join(self.root, folder)
        return importlib.util.spec_from_file_location(fullname, os.path.join(location, "__init__.py"),
                                                      submodule_search_locations=[location])


def _map_checkout_folders():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    if not os.path.isdir(os.path.join(here, "kernels")) and os.path.isfile(os.path.join(root, "kernels", "__init__.py")):
        sys.meta_path.insert(0, _CheckoutFolders(root))


_map_checkout_folders()

from overlap_tp.ops.config import OverlapConfig  # noqa: E402  (after the folders are mapped)
from overlap_tp.ops.expert import a2a_gemm, gemm_a2a  # noqa: E402
from overlap_tp.ops.ag_gemm import ag_gemm  # noqa: E402
from overlap_tp.ops.gemm_ar import gemm_ar  # noqa: E402
from overlap_tp.ops.gemm_rs import gemm_rs  # noqa: E402
from overlap_tp import tune  # noqa: F401,E402  (registers the tuner as the op layer's resolver of method='auto')

__all__ = ["OverlapConfig", "ag_gemm", "gemm_rs", "gemm_ar", "a2a_gemm", "gemm_a2a"]
__version__ = "0.1.0"
