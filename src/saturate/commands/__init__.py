"""The `saturate` command's commands, one module each: train (train.py's too), eval and export (their
own flags and action; saturate.cli holds what the two share), and the tools, each with `main(argv)`
(saturate.cli.command dispatches to them)."""
