"""The composition root: `train(cfg)` builds a run's parts from their config nodes in order
(build), hands them to the loop, and records what the run leaves behind (outcome)."""
