"""Launchers (installed as `overlap_tp.launch`): the environment check now; the torchrun training entry
point and the SLURM template arrive with the training integration."""
