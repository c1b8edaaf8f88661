"""How often a compiled graph reads the device on the host, counted on the graph dynamo captures.

On a GPU each read of a device tensor by the host (``.item()``, ``.tolist()``, a device-to-host copy) is a
synchronization. The tests run on gloo CPU ranks, where the "device" is the CPU too, so a read is told from
a free host read by where its tensor came from: a tensor is on the *host* only where the graph made it so,
by an explicit copy to the CPU of a device tensor (``.to("cpu")``, ``.cpu()``) or by computing from such host
tensors alone (a scalar tensor made from Python values, ``torch.tensor((1,))``, counts as host too); every other
tensor (the graph's inputs, factories, anything mixed) is a *device* tensor. Then

* a *device-to-host copy* is a copy to the CPU of a device tensor (one synchronization on a GPU);
* a *device read* is an ``item`` / ``tolist`` / ``_local_scalar_dense`` of a device tensor (one synchronization
  each on a GPU; an ``item`` of a host tensor is free).

A copy to the CPU of a host tensor is a host-to-device copy on a GPU (``torch.tensor(values).to(device)``
traced on the CPU): its result counts as a device tensor.
"""

from __future__ import annotations

import torch

_READS = {"item", "tolist", "_local_scalar_dense"}
_CPU_METHODS = {"to", "cpu", "_to_copy"}
_FACTORIES = {"tensor", "scalar_tensor"}


def _name(node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    return getattr(t, "__name__", str(t)).split(".")[0]


def _to_cpu(node) -> bool:
    """``node`` copies its tensor to the CPU (``.to("cpu")``, ``.to(device=...)``, ``.cpu()``)."""
    name = _name(node)
    if name == "cpu":
        return True
    if name not in _CPU_METHODS:
        return False
    targets = list(node.args[1:]) + [node.kwargs.get("device")]
    return any(isinstance(a, (torch.device, str)) and torch.device(a).type == "cpu" for a in targets)


def count(gm: torch.fx.GraphModule) -> dict:
    """``{"copies": device-to-host copies, "reads": device reads, "nodes": nodes of the graph}`` of a graph
    dynamo captured (see the module doc)."""
    host: set = set()
    copies = reads = 0
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        inputs = [a for a in node.all_input_nodes if a.op != "get_attr"]
        on_host = bool(inputs) and all(a in host for a in inputs)
        name = _name(node)
        if _to_cpu(node):
            if on_host:  # a host value moved "to the device" (which is the CPU here)
                continue
            copies += 1
            host.add(node)
        elif name in _READS:
            if not on_host:
                reads += 1
        elif on_host or (not inputs and name in _FACTORIES and "device" not in node.kwargs):
            host.add(node)
    return {"copies": copies, "reads": reads, "nodes": len(gm.graph.nodes)}


def recording_backend(graphs: list, inner: str = "aot_eager"):
    """A ``torch.compile`` backend that appends each graph dynamo hands it to ``graphs``, then compiles it with
    ``inner``."""
    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend(inner)(gm, example_inputs)

    return backend


__all__ = ["count", "recording_backend"]
