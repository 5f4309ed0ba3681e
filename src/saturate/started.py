"""When this process first imported saturate (time.perf_counter()): where a run's start-up is
counted from when the process's own start says nothing (a shell that ran `pip install ... &&
python train.py` and exec'd python keeps its own start time, minutes earlier)."""

import time

IMPORTED_AT = time.perf_counter()
