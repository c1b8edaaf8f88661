"""The byte-fingerprint kernel (the reuse scope's exit check): ``config``, ``kernel``, ``ops``."""
