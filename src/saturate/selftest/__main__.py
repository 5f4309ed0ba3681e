"""python -m saturate.selftest [...]: the same as `saturate selftest [...]`."""

import sys

from saturate.selftest import main

sys.exit(main())
