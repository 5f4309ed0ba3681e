"""The `saturate` command's tools besides training, evaluating and exporting: one module a
command, each with `main(argv)` (saturate.cli.command dispatches to them)."""
