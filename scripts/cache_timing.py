"""First call of a kernel variant in a fresh process: compile (empty cache dir) vs on-disk cache hit.

    python scripts/cache_timing.py   # runs two child processes sharing a temporary MOE_QUANT_CACHE_DIR
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

# Runnable as `python scripts/cache_timing.py` from the repository root (the children import moe_quant from it too).
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.timing import require_cuda  # noqa: E402

CHILD = r"""
import time
t0 = time.perf_counter()
import torch
torch.cuda.init(); torch.empty(1, device="cuda")
t1 = time.perf_counter()
from moe_quant.kernels import ops
x = torch.randn(1000, 256, device="cuda").bfloat16()
offs = torch.tensor([100, 600, 1000], dtype=torch.int32, device="cuda")
t2 = time.perf_counter()
d, s = ops.quantize_1x32(x, "rceil", offs)
torch.cuda.synchronize()
t3 = time.perf_counter()
print(f"torch+cuda init {t1 - t0:.3f}s | first quantize_1x32 call {t3 - t2:.3f}s | stats {ops.STATS}")
"""

CHILD_IMPORT = r"""
import time
import torch
t0 = time.perf_counter()
import tvm_ffi
t1 = time.perf_counter()
import cutlass, cutlass.cute
t2 = time.perf_counter()
print(f"import tvm_ffi {t1 - t0:.3f}s, import cutlass {t2 - t1:.3f}s (after torch)")
"""

require_cuda()
with tempfile.TemporaryDirectory() as d:
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, MOE_QUANT_CACHE_DIR=d, PYTHONPATH=pythonpath)
    for label in ("process 1 (empty cache: compile)", "process 2 (disk cache)"):
        r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
        print(label, "->", r.stdout.strip() or r.stderr[-2000:])
    r = subprocess.run([sys.executable, "-c", CHILD_IMPORT], env=env, capture_output=True, text=True)
    print(r.stdout.strip() or r.stderr[-2000:])
