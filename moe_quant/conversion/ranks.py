"""Ranks that parallelize converted experts agree on their settings, or all raise the same error.

torchtitan's ``Module.parallelize(parallel_dims)`` runs on every rank, for the same modules in the same order
(it shards parameters over meshes: it has no meaning on one rank alone), after the process group is up and the
device set, before anything is compiled or any token sent. A converted torchtitan module's ``parallelize``
(:mod:`.classes`) first exchanges :func:`settings` once (one ``all_gather_object``) over the ranks that
parallelize the same modules: the whole world without pipeline parallelism, else the expert-parallel group
(every rank of it holds the same pipeline stage), none on one rank or without a process group. Every rank
then holds every rank's settings and raises the same ``ValueError`` (:func:`diagnose`) where they differ.

The settings of a module: its :class:`MXFP8MoEConfig`'s fields, then the settings its builder attached
(:func:`attach`; torchtitan's model converter attaches its own: ``dispatcher`` and, with moe_quant's
dispatcher, the dispatcher's). With ``MXFP8MoEConverter(dispatcher=False)`` this is the only comparison of the
ranks' settings; with moe_quant's dispatcher its one-time handshake (:mod:`moe_quant.ep.agree`) follows.

:class:`moe_quant.moe.EPMoE` (no ``parallelize``): its dispatcher's one-time handshake carries a digest of
:func:`experts_settings` (its experts, converted or not); where the digests differ, the ranks exchange those
settings once more (``all_gather_object``) and all raise :func:`diagnose`'s ``ValueError``.
"""

from __future__ import annotations

import dataclasses
import enum

import torch
import torch.distributed as dist

EXTRA = "_mxfp8_settings"  # a converted module's own attribute: the settings its builder attached


def _plain(value):
    """A setting as the user wrote it (enums by their value, dtypes by name): picklable, readable."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, torch.dtype):
        return str(value)
    return value


def attach(module, extra: dict) -> None:
    """Settings besides the conversion config that the ranks compare (e.g. a model converter's own)."""
    module.__dict__[EXTRA] = dict(extra)


def settings(module) -> dict:
    """What the ranks compare: the module's conversion config, then the attached settings."""
    config = module._mxfp8_config
    out = {f.name: _plain(getattr(config, f.name)) for f in dataclasses.fields(config)}
    out.update(module.__dict__.get(EXTRA) or {})
    return out


def experts_settings(module, converted: bool) -> dict:
    """What EP ranks compare of the experts they run: ``converted`` (``is_converted(module)``, which the caller
    knows) and, where converted, :func:`settings`."""
    return {"converted": True, **settings(module)} if converted else {"converted": False}


def group_of(parallel_dims):
    """The process group whose ranks parallelize the same modules, or None (no check): see the module doc."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if getattr(parallel_dims, "pp_enabled", False):
        mesh = parallel_dims.get_optional_mesh("ep") if getattr(parallel_dims, "ep_enabled", False) else None
        return mesh.get_group() if mesh is not None and mesh.size() > 1 else None
    return dist.group.WORLD


def diagnose(rows: list, checked: str = "when the model is parallelized") -> str | None:
    """``rows``: (global rank, :func:`settings`) of every rank of the group. The error every rank raises, or
    None when all agree. Names the settings that differ, each rank's values (ranks with equal values grouped),
    and when that was ``checked``."""
    names = list(dict.fromkeys(name for _, s in rows for name in s))
    missing = object()
    differ = [n for n in names if len({repr(s.get(n, missing)) for _, s in rows}) > 1]
    if not differ:
        return None
    groups: dict = {}
    for rank, s in rows:
        text = ", ".join(f"{n}={s[n]!r}" for n in differ if n in s) or "none of these set"
        groups.setdefault(text, []).append(rank)
    parts = "; ".join(f"rank {ranks[0]}: {text}" if len(ranks) == 1 else
                      f"ranks {', '.join(map(str, ranks))}: {text}" for text, ranks in groups.items())
    return (f"moe_quant: ranks disagree on the converted experts' settings ({parts}). Launch every rank with the "
            f"same moe_quant settings (torchtitan: the same MXFP8MoEConverter / converter_config arguments; "
            f"quantize_: the same MXFP8MoEConfig). Checked {checked}, before any token is sent")


def check(module, parallel_dims) -> None:
    """The exchange (see the module doc); raises :func:`diagnose`'s ``ValueError`` on every rank alike."""
    group = group_of(parallel_dims)
    if group is None:
        return
    rows = [None] * dist.get_world_size(group)
    dist.all_gather_object(rows, (dist.get_rank(), settings(module)), group=group)
    message = diagnose(rows)
    if message is not None:
        raise ValueError(message)


__all__ = ["EXTRA", "attach", "check", "diagnose", "experts_settings", "group_of", "settings"]
