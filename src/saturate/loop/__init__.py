"""The training loop (engine), one optimizer step (step), evaluation (evaluate) and what stops a
run early (faults). The loop receives built objects and never reads a config."""
