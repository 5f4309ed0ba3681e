"""Measuring and explaining a run: step timing, resource sampling (NVML, psutil), a step's
cost (FLOPs, launches), metric tracking, the environment fingerprint and doctor, the
bottleneck report and reading sweeps back."""
