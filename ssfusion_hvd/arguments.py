"""Validation of ``DistributedOptimizer``'s arguments: pure functions of the arguments,
so every rank raises the same ``ValueError`` before any collective is submitted."""
from __future__ import annotations

import math
import numbers
import warnings

import torch

from .core.wire import SPARSE_GRAD_DTYPES

__all__ = ["named_parameters", "check_arguments"]


def named_parameters(named_parameters, param_groups):
    """Validated (name, param) list in canonical order; raises ValueError like Horovod."""
    if named_parameters is not None:
        named = list(named_parameters)
    else:
        named = [(f"allreduce.noname.{i}.{j}", v) for i, g in enumerate(param_groups)
                 for j, v in enumerate(g["params"])]
    if any(not isinstance(t, tuple) or len(t) != 2 for t in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    seen, dups = set(), set()
    for name, _ in named:
        (dups if name in seen else seen).add(name)
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. "
                         f"Found duplicates: {', '.join(sorted(dups))}")
    named_ids = {id(v) for _, v in named}
    unnamed = [v for g in param_groups for v in g["params"] if id(v) not in named_ids]
    if unnamed:
        shapes = ", ".join(str(tuple(v.shape)) for v in unnamed)
        raise ValueError("named_parameters was specified, but one or more model parameters "
                         f"were not named (shapes: {shapes})")
    in_groups = {id(v) for g in param_groups for v in g["params"]}
    # parameters named but not optimized are not synchronized (Horovod ignores them too)
    return sorted(((k, v) for k, v in named if id(v) in in_groups), key=lambda t: t[0])


def _check_choice(kind, value, registry):
    if not isinstance(value, str) or value not in registry:
        raise ValueError(f"unknown {kind} {value!r}; available: {', '.join(sorted(registry))}")


def _check_density(density):
    ok = (isinstance(density, numbers.Real) and not isinstance(density, bool)
          and math.isfinite(float(density)) and 0.0 < float(density) <= 1.0)
    if not ok:
        raise ValueError(f"density must be a number in (0, 1], got {density!r}")
    return float(density)


def _positive_int(name, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_groups(groups, num_groups, scheme):
    """Horovod's ``groups``/``num_groups`` rules; returns the groups in force."""
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed "
                      "in v0.23.0.", DeprecationWarning)
        if groups is None:
            groups = num_groups
    if isinstance(groups, list):
        seen = set()
        for p in (p for g in groups for p in g):
            if not isinstance(p, torch.Tensor):
                raise ValueError("groups must consist of torch.Tensor.")
            if id(p) in seen:
                raise ValueError("A parameter can only appear once in groups.")
            seen.add(id(p))
    elif groups is not None and (isinstance(groups, bool) or not isinstance(groups, int)
                                 or groups <= 0):
        raise ValueError("groups should be a non-negative integer or a list of list of "
                         "torch.Tensor.")
    if groups is not None and scheme != "dense":
        warnings.warn(f"groups is ignored by scheme={scheme!r}: its plan decides the fusion groups")
    return groups


def check_arguments(optimizer, scheme, sparsifier, scheme_options, density, warmup_steps,
                    backward_passes_per_step, op, gradient_predivide_factor, num_groups, groups,
                    grad_scaler=None):
    """Every argument check that needs no collective; returns ``(scheme options with
    defaults, density as float, groups in force)``."""
    from .core.transport import Average
    from .registry import SCHEMES
    from .sparsify import SPARSIFIERS

    _check_choice("scheme", scheme, SCHEMES)
    _check_choice("sparsifier", sparsifier, SPARSIFIERS)
    options = SCHEMES[scheme].load().parse_options(scheme_options)
    density = _check_density(density)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    _positive_int("warmup_steps", warmup_steps)
    _positive_int("backward_passes_per_step", backward_passes_per_step)
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
        raise ValueError(f"grad_scaler must be a torch.amp.GradScaler, got "
                         f"{type(grad_scaler).__name__}")
    if scheme != "dense":
        _check_sparse_dtypes(optimizer, scheme)
    return options, density, _check_groups(groups, num_groups, scheme)


def _check_sparse_dtypes(optimizer, scheme) -> None:
    """A sparse scheme takes trainable parameters of one float dtype it supports on one
    device; said here, on every rank, before the first collective (the schemes check it
    again where they are built)."""
    kinds = {(p.dtype, p.device) for g in optimizer.param_groups for p in g["params"]
             if p.requires_grad}
    bad = sorted({str(d) for d, _ in kinds if d not in SPARSE_GRAD_DTYPES})
    if bad:
        raise ValueError(f"scheme {scheme!r} supports parameters of "
                         f"{', '.join(map(str, SPARSE_GRAD_DTYPES))}, got {', '.join(bad)}; "
                         "use scheme='dense'")
    if len(kinds) > 1:
        raise ValueError(f"scheme {scheme!r} needs every trainable parameter in one dtype on "
                         f"one device, got {sorted(map(str, kinds))}; use scheme='dense'")
