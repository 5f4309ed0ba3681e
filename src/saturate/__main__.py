"""python -m saturate selftest|eval|export ...: the `saturate` command."""

from saturate.cli import command

command()
