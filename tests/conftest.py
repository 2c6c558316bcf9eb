import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# The GEMM algorithms a GPU run times are kept in a file of the test process's own (the scripts
# and ranks it starts inherit it), not in the user's cache; its folder is made only where a
# choice is written (on a GPU).
os.environ.setdefault("CUPYTP_GEMM_CACHE", os.path.join(
    tempfile.gettempdir(), f"cupytp-tests-{os.getpid()}", "gemm_algorithms.json"))
