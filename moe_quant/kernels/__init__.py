"""CuTe-DSL kernels, one subpackage per family (``config`` + ``kernel`` + ``ops``, design notes in ``NOTES.md``):
``quantize_1x32``, ``quantize_32x1``, ``block``, ``permute``, ``fingerprint``. Shared by all of them:
``compile_cache`` (compiles, caches and launches), ``cute_utils`` (device helpers), ``compile_check`` (CI's
cross-compile of every variant); ``ops`` gathers the public quantization ops."""
