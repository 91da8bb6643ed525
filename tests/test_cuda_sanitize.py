"""The sanitizer lane finds the bugs it is for (make test-sanitize; skipped otherwise).

Each case builds the harness kernels with one sanitizer in a fresh process (the runtime
must be preloaded into Python) and runs a kernel with a planted bug: a missing
``__syncthreads`` (thread), a read past the end (address), a shift by 32 (undefined).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpicomp.env import env_flag

if not env_flag("MPICOMP_TEST_SANITIZERS"):
    pytest.skip(
        "make test-sanitize runs these (MPICOMP_TEST_SANITIZERS=1)", allow_module_level=True
    )

HARNESS = Path(__file__).parent / "cuda" / "harness.cu"
RUNTIME = {"thread": "libtsan.so", "address": "libasan.so", "undefined": "libubsan.so"}

JOB = """
import sys
import numpy as np
from pathlib import Path
from mpicomp.kernels.cuda import emulated
from mpicomp.kernels.cuda.device import options
m = emulated.RawModule(Path(sys.argv[1]).read_text(), options("harness"), name="harness")
kernel, n, size, threads, arg = sys.argv[2], 256, 256, 256, np.int32(256)
if kernel == "read_past_end":
    n, threads, arg = 100, 128, np.int32(100)
if kernel == "shift_by_width":
    threads, arg = 32, np.int32(32)
dtype = np.uint32 if kernel == "shift_by_width" else np.float32
x, y = np.ones(n, dtype), np.zeros(max(n, threads), dtype)
m.get_function(kernel)((1,), (threads,), (x, y, arg))
print("no report")
"""


@pytest.mark.parametrize(
    "sanitizer, kernel, report",
    [
        ("thread", "racy_shift", "ThreadSanitizer: data race"),
        ("address", "read_past_end", "AddressSanitizer: heap-buffer-overflow"),
        ("undefined", "shift_by_width", "shift exponent 32 is too large"),
    ],
)
def test_each_sanitizer_reports_its_planted_bug_with_a_line(tmp_path, sanitizer, kernel, report):
    lib = subprocess.run(
        ["g++", f"-print-file-name={RUNTIME[sanitizer]}"], capture_output=True, text=True
    ).stdout.strip()
    env = dict(
        os.environ,
        MPICOMP_EMULATED_SANITIZE=sanitizer,
        MPICOMP_EMULATED_CACHE=str(tmp_path),
        LD_PRELOAD=lib,
        ASAN_OPTIONS="detect_leaks=0",
    )
    done = subprocess.run(
        [sys.executable, "-c", JOB, str(HARNESS), kernel],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert report in done.stderr, done.stderr[-2000:]
    assert "harness.cu:" in done.stderr  # the report points at the source line
