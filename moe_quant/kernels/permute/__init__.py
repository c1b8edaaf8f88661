"""The received-rows permutation kernel (expert parallelism): ``config``, ``kernel``, ``ops``."""
