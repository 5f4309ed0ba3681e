"""The built objects the loop receives, each from its own config node: the device, the
precision policy, the model placed and wrapped, the optimizer and schedule, checkpoints, the
batch-size search and the run directory."""
