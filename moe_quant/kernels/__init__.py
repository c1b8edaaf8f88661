"""CuTe-DSL kernels: one family per `config_*.py` + kernel module + `ops_*.py`; `compile_cache` compiles, caches and launches them (`ops` gathers the public torch ops)."""
