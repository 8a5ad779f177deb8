"""Launchers (installed as `overlap_tp.launch`): `run` (`overlap-tp-run SCRIPT ...`: any Megatron-LM training
script with overlap_tp), `env_check` (what this machine can run), `pretrain` (Megatron's pretrain flow with
overlap_tp's arguments, the recipes' torchrun entry point), `check` (both launchers' `--check`: Megatron's and
overlap_tp's argument validation on the CPU) and `slurm_template.sh` (multi-node torchrun
rendezvous)."""
