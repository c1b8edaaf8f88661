"""Drop-in model conversion: ``quantize_(model, MXFP8MoEConfig(), filter_fn=...)``.

A matched expert module is converted in place: its class becomes a generated subclass whose
forward runs its grouped GEMMs (forward, dgrad, wgrad) in MXFP8; its parameters stay plain
``nn.Parameter`` objects, so everything PyTorch does with parameters (autograd's saved-tensor
checks, views, optimizers, ``state_dict``, pickling, FSDP2, ``torch.func``) is PyTorch's own
machinery, unchanged. ``torch.compile`` traces the converted forward. docs/design.md section 8.1
says why this design and not a weight tensor subclass.

The pieces, one module each:

* :mod:`.config` -- :class:`MXFP8MoEConfig` (no kernel imports);
* :mod:`.fallbacks` -- :func:`fallback_counts`: GEMMs MXFP8 could not serve;
* :mod:`.gemm` -- one grouped-mm or bmm call: MXFP8, or the counted fallback;
* :mod:`.experts` -- :func:`swiglu_experts`, the converted forwards of moe_quant's and torchtitan's
  ``GroupedExperts``;
* :mod:`.hf` -- transformers' experts interface implementation ``"moe_quant_mxfp8"`` and Llama4;
* :mod:`.own_forward` -- the converted forward of a module conversion has no forward for: its own, its
  grouped-mm calls routed to MXFP8;
* :mod:`.linear` -- the converted ``nn.Linear`` of experts written as a list of per-expert modules: one MXFP8 GEMM
  of one group;
* :mod:`.layers` -- classes PyTorch layers over a module's class (parametrizations, FSDP2), and swapping
  one class under them;
* :mod:`.classes` -- the generated converted classes (cached by class, picklable);
* :mod:`.handler` -- the ``quantize_`` handler, :func:`convert` / :func:`unconvert`;
* :mod:`.model` -- ``moe_quant.convert(model, config, filter_fn=...)``: ``quantize_`` that returns what it
  converted and raises when nothing did.
"""

from .classes import SUPPORTED, converted_class, is_converted
from .config import MXFP8MoEConfig
from .experts import swiglu_experts
from .fallbacks import fallback_counts, reset_fallback_counts
from .handler import convert, unconvert
from .hf import register_experts_implementation

__all__ = [
    "MXFP8MoEConfig",
    "SUPPORTED",
    "convert",
    "converted_class",
    "fallback_counts",
    "is_converted",
    "register_experts_implementation",
    "reset_fallback_counts",
    "swiglu_experts",
    "unconvert",
]
