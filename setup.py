"""overlap_tp: signaled GEMM + collective overlap for Megatron tensor/sequence/expert parallelism.

`kernels/`, `megatron_patches/` and `launch/` are installed as subpackages of `overlap_tp` so the
repository keeps the folders people look for while Python sees one namespace (a top-level
`kernels` would collide with an existing PyPI package).
"""
from setuptools import setup

setup(
    name="overlap_tp",
    version="0.1.0",
    description="Overlapped TP/SP/EP communication for Megatron through signaled Triton GEMMs",
    python_requires=">=3.10",
    packages=[
        "overlap_tp",
        "overlap_tp.ops",
        "overlap_tp.megatron",
        "overlap_tp.training",
        "overlap_tp.bench",
        "overlap_tp.tune",
        "overlap_tp.kernels",
        "overlap_tp.megatron_patches",
        "overlap_tp.launch",
    ],
    package_dir={
        "overlap_tp": "overlap_tp",
        "overlap_tp.kernels": "kernels",
        "overlap_tp.megatron_patches": "megatron_patches",
        "overlap_tp.launch": "launch",
    },
    install_requires=["torch>=2.6", "triton>=3.4", "numpy"],
    extras_require={
        # Triton 3.6's CPU interpreter (the CPU tests; 3.6 is what the GPU machines run) breaks on
        # numpy >= 2.3, which refuses to turn its one-element scalar arrays into Python ints. Triton 3.9's
        # passes the tests with numpy 2.4, but triton>=3.4 admits 3.6, so the cap stays.
        # matplotlib: the training report (overlap_tp.training.report) and its test.
        "dev": ["pytest>=7", "numpy<2.3", "matplotlib"],
        # megatron.training (the launchers, the recipes) ships with megatron-core >= 0.19, which needs
        # Python >= 3.12; on older Pythons pip finds no such release and says so.
        "megatron": ["megatron-core>=0.19"],
        # wandb-workspaces: the W&B dashboard (python -m overlap_tp.training.wandb_dashboard).
        "wandb": ["wandb", "wandb-workspaces"],
        "report": ["matplotlib"],
    },
    entry_points={
        "console_scripts": [
            "overlap-tp-pretrain = overlap_tp.launch.pretrain:main",
            "overlap-tp-run = overlap_tp.launch.run:main",
            "overlap-tp-report = overlap_tp.training.report:main",
        ],
    },
)
