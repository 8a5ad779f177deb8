"""Launchers (installed as `overlap_tp.launch`): `env_check` (what this machine can run), `pretrain`
(Megatron's pretrain flow with overlap_tp's arguments, torchrun entry point) and `slurm_template.sh`
(multi-node torchrun rendezvous)."""
