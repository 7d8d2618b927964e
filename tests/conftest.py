"""Test-session defaults.

* ``JAX_PLATFORMS=cpu`` (unless set): the suite runs on the CPU (kernels in interpret mode).
  With ``jax[tpu]`` installed (CI's TPU compile step) JAX would otherwise first try to bring
  up a TPU backend; the TPU compile tests need no TPU backend, only libtpu's compiler on
  abstract topology devices (``kernels_pallas.aot``). Set ``JAX_PLATFORMS=tpu`` on a TPU VM.
* ``ALLOW_MULTIPLE_LIBTPU_LOAD=1``: compile-only use of libtpu by several processes at once
  (subprocess tests, a concurrent ``scripts/compile_check.py``) instead of failing on
  libtpu's lockfile.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
