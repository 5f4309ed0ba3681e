"""Several processes: where this process stands among a run's ranks (ranks, torch-free), the
process group and DDP (distributed), and starting the ranks (launch: trainer.devices, torchrun,
SLURM)."""
