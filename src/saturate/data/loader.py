"""Batches for the loop: the loaders' code moves to saturate.data.resident and its neighbours;
their names stay importable from here."""

from saturate.data.resident import *  # noqa: F403
from saturate.data.resident import _check_loadable  # noqa: F401
