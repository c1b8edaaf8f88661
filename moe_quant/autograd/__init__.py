from .grouped_mm import mxfp8_grouped_mm

__all__ = ["mxfp8_grouped_mm"]
