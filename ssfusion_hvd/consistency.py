"""Checks that every rank built the same model before any gradient travels.

Horovod matches collectives by name and trusts that every rank submits tensors of the
same shape in the same order. A rank that built a different model (another layer size, an
extra layer, parameters handed to the optimizer in another order) would otherwise fail far
from the cause: a shape error inside a fused allreduce, a stall, or silently wrong sparse
indices. :func:`check_same_model` exchanges a small signature of the model once, with a
single allgather of bytes, and raises ``ValueError`` with the same message on every rank
when the signatures differ, so that no rank is left waiting on a collective.
"""
from __future__ import annotations

import ast
import functools

__all__ = ["model_signature", "check_same_model", "mismatch_message"]

_NAME = "ssfusion.check_same_model"


def model_signature(named, declared_names) -> list:
    """What every rank must agree on, as plain picklable values.

    ``named``: (name, tensor) pairs, sorted by name. ``declared_names``: the parameter
    names in the order of the optimizer's ``param_groups``. Returns one
    ``(name, shape, dtype, requires_grad)`` tuple per parameter, in the order of ``named``,
    followed by the tuple of declared names as the last element.
    """
    entries = [(str(name), tuple(int(d) for d in t.shape), str(t.dtype), bool(t.requires_grad))
               for name, t in named]
    return entries + [tuple(str(n) for n in declared_names)]


def _split(signature):
    return signature[:-1], signature[-1]


def _first_difference(sig, ref, rank, ref_rank) -> tuple[str, int] | None:
    """The first way ``sig`` (of ``rank``) differs from ``ref`` (of ``ref_rank``), and how
    many differences there are in all; None when they are identical."""
    entries, declared = _split(sig)
    ref_entries, ref_declared = _split(ref)
    mine = {e[0]: e for e in entries}
    theirs = {e[0]: e for e in ref_entries}
    found = []
    for name in sorted(set(mine) | set(theirs)):
        if name not in theirs:
            found.append(f"rank {rank} has parameter {name!r} that rank {ref_rank} lacks")
            continue
        if name not in mine:
            found.append(f"rank {rank} lacks parameter {name!r} that rank {ref_rank} has")
            continue
        (_, shape, dtype, grad), (_, ref_shape, ref_dtype, ref_grad) = mine[name], theirs[name]
        if shape != ref_shape:
            found.append(f"rank {rank}: parameter {name!r} has shape {shape}, "
                         f"rank {ref_rank} has {ref_shape}")
        elif dtype != ref_dtype:
            found.append(f"rank {rank}: parameter {name!r} has dtype {dtype}, "
                         f"rank {ref_rank} has {ref_dtype}")
        elif grad != ref_grad:
            found.append(f"rank {rank}: parameter {name!r} has requires_grad={grad}, "
                         f"rank {ref_rank} has requires_grad={ref_grad}")
    if not found and declared != ref_declared:
        pos = next((i for i, (a, b) in enumerate(zip(declared, ref_declared)) if a != b),
                   min(len(declared), len(ref_declared)))
        here = repr(declared[pos]) if pos < len(declared) else "nothing"
        there = repr(ref_declared[pos]) if pos < len(ref_declared) else "nothing"
        found.append(f"parameters are declared in a different order on rank {rank}: "
                     f"optimizer parameter #{pos} is {here} on rank {rank}, "
                     f"{there} on rank {ref_rank}")
    if not found:
        return None
    return found[0], len(found)


def mismatch_message(signatures, ranks=None) -> str | None:
    """The error message for gathered ``signatures`` (one per rank, in rank order), or None
    when all equal ``signatures[0]``. ``ranks`` labels them (default 0, 1, ...)."""
    ranks = list(range(len(signatures))) if ranks is None else list(ranks)
    lines = []
    for rank, sig in zip(ranks[1:], signatures[1:]):
        diff = _first_difference(sig, signatures[0], rank, ranks[0])
        if diff is not None:
            first, count = diff
            more = f" (and {count - 1} more difference{'s' if count > 2 else ''})" \
                if count > 1 else ""
            lines.append((rank, first + more))
    if not lines:
        return None
    which = ", ".join(str(r) for r, _ in lines)
    plural = "s" if len(lines) > 1 else ""
    return (f"the model differs across ranks: rank{plural} {which} differ{'' if plural else 's'} "
            f"from rank {ranks[0]}. All ranks must build the same model (same parameter names, "
            f"shapes, dtypes and requires_grad, handed to the optimizer in the same order) "
            f"before wrapping the optimizer in ssfusion_hvd.DistributedOptimizer. "
            f"First difference per rank:\n"
            + "\n".join(f"  {text}" for _, text in lines))


def check_same_model(named, declared_names, process_set=None, setup=None) -> None:
    """Raises ``ValueError`` on every rank of ``process_set`` unless all built the same model
    (and, when given, the same ``setup``: scheme name and options, the wrapped optimizer's
    family and the ``moments`` argument; plain values).

    One allgather over ``process_set`` (``None``: the global one); nothing when the set has a
    single rank or this rank is not in it. See :func:`model_signature` for what is compared.
    """
    from .core import transport

    process_set = transport.global_process_set if process_set is None else process_set
    if process_set.included() is False or (process_set.size() or 1) <= 1:
        return
    signature = model_signature(named, declared_names)
    # repr/literal_eval: plain values only, nothing executed when reading a peer's bytes
    chunks = transport.allgather_bytes(repr((signature, setup)).encode(), _NAME, process_set)
    gathered = [ast.literal_eval(c.decode()) for c in chunks]
    ranks = process_set.ranks if process_set.ranks and len(process_set.ranks) == len(
        gathered) else list(range(len(gathered)))
    message = mismatch_message([sig for sig, _ in gathered], ranks)
    if message is None:
        differ = [r for r, (_, st) in zip(ranks, gathered) if st != gathered[0][1]]
        if differ:
            message = (f"the optimizer's setup differs across ranks: rank{'s' if len(differ) > 1 else ''} "
                       f"{', '.join(map(str, differ))} run {gathered[ranks.index(differ[0])][1]!r}, "
                       f"rank {ranks[0]} runs {gathered[0][1]!r}. Every rank must pass the same "
                       f"scheme, scheme_options, kind of optimizer and moments to "
                       f"ssfusion_hvd.DistributedOptimizer.")
    if message is not None:
        raise ValueError(message)


def model_check(named, param_groups, process_set=None, setup=None):
    """:func:`check_same_model` for the parameters ``named`` (``(name, tensor)`` pairs) as
    ``param_groups`` declare them, bound and ready to run (the optimizer's first
    collective, or under Horovod elastic its check at every broadcast adoption)."""
    name_of = {id(v): k for k, v in named}
    declared = [name_of[id(v)] for g in param_groups for v in g["params"] if id(v) in name_of]
    return functools.partial(check_same_model, named, declared, process_set, setup=setup)
