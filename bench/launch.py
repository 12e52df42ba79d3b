"""`tether` under uvloop, for `bench.run --uvloop`: what the event loop alone would give.

    python -m bench.launch services NAME     (same arguments as `tether`)

The services use asyncio's default loop; this installs uvloop's policy first and then
runs the unchanged CLI, so the comparison needs no change to the services.
"""

import sys

import uvloop

from tether.cli import main

if __name__ == "__main__":
    uvloop.install()
    sys.exit(main())
