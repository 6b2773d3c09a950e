"""A stand-in server process for ``Server`` lifecycle tests: takes any flags, writes its pid to
``$NEVER_SERVES_PID`` and never serves (a real server's slow start, e.g. CUDA-graph capture)."""

import os
import time

if __name__ == "__main__":
    with open(os.environ["NEVER_SERVES_PID"] + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.environ["NEVER_SERVES_PID"] + ".tmp", os.environ["NEVER_SERVES_PID"])
    time.sleep(600)
