"""Error feedback: each rank's residual and the local rule's state it accumulates.

A rank that sends only part of a tensor keeps the rest in its *residual* and adds it to
the next step's contribution (Seide et al. 2014; Stich et al. 2018; GRACE's Memory).
What it accumulates is given by a local rule (``ssfusion_hvd/rules.py``: the raw
gradient, DGC's velocity or Adam's update).

Bookkeeping is exact (one rounding, here)::

    acc      = residual + rule(grad)
    sent     = acc at the selected indices, rounded to the wire dtype
    residual = acc − sent                     (zero where sent, when the wire is exact)

so nothing a rank computed is lost. With ``dtype=torch.float32`` and float16 gradients,
accumulation, selection input and residuals are float32 and only the sent values are
rounded to float16; the rounding error stays in the residual.

State is keyed by a name (a tensor, a fusion buffer, the whole flat gradient) and lives
on flat tensors: one fused op per buffer, never a Python loop over the tensors inside it.
:meth:`ResidualMemory.register` records which parameters a key covers, so that
:meth:`~ResidualMemory.named_state` / :meth:`~ResidualMemory.load_named_state` save and
restore every buffer per parameter name, independent of how a plan groups tensors.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import ops
from ..rules import GradientRule, LocalRule

__all__ = ["ResidualMemory"]


def _fused_select(grad, residual, k, offsets, ks, wire, velocity: dict):
    """The fused error-feedback selection :meth:`ResidualMemory.select_topk` asks for: one
    ``k`` (``ops.ef_topk``), ``ks`` per segment (``ops.segmented_ef_topk``), or ``k`` over
    the segments with ``ks`` as floors (``ops.group_ef_topk``)."""
    if offsets is None:
        return ops.ef_topk(grad, residual, k, wire, **velocity)
    if k is None:
        return ops.segmented_ef_topk(grad, residual, offsets, ks, wire, **velocity)
    return ops.group_ef_topk(grad, residual, offsets, ks, k, wire, **velocity)


class ResidualMemory:
    """Residuals plus the local rule's state, keyed by name (see the module docstring).

    ``dtype``: the accumulation dtype (None: the gradient's). ``rule``: a
    :class:`LocalRule` (default: plain error feedback).
    """

    def __init__(self, rule: Optional[LocalRule] = None, dtype: Optional[torch.dtype] = None):
        self.rule = rule if rule is not None else GradientRule()
        self.rule.seed = self._seed_key
        self.dtype = dtype
        self.residuals: Dict[str, torch.Tensor] = {}
        self._layout: Dict[str, List[Tuple[str, int, int, torch.Size]]] = {}
        self._device: Dict[str, Optional[torch.device]] = {}
        #: ``seed_from(names, buffers) -> ({buffer: flat tensor}, step) or None``: where a
        #: registered key's rule state starts (the recipe hands over the wrapped
        #: optimizer's state of tensors that were synchronized densely until now)
        self.seed_from: Optional[Callable] = None
        #: per key, the clock of :meth:`sent_waits` and each element's clock reading when
        #: this rank last sent it (int32; keys whose wire carries waits only)
        self.clock: Dict[str, int] = {}
        self.sent_at: Dict[str, torch.Tensor] = {}
        #: per key, each element's sum of squared gradients since this rank last sent it
        #: (keys whose wire carries spreads only: :meth:`add_squares`, :meth:`sent_spreads`)
        self.squares: Dict[str, torch.Tensor] = {}
        #: per key, each element's sum of gradients over the same window, where a scheme
        #: reads the window's variance itself (:meth:`window_variances`)
        self.sums: Dict[str, torch.Tensor] = {}
        self._saved = None  # checkpoint(): the state before the step in flight
        self._shadow: Dict[tuple, torch.Tensor] = {}  # checkpoint()'s copies, reused

    def _seed_key(self, key: str, buffers: Tuple[str, ...]):
        layout = self._layout.get(key)
        if self.seed_from is None or layout is None or not buffers:
            return None
        return self.seed_from([n for n, *_ in layout], buffers)

    # ------------------------------------------------------------------ layout
    def register(self, key: str, names: Sequence[str], shapes: Sequence[torch.Size],
                 device: Optional[torch.device] = None) -> None:
        """Key ``key`` holds the tensors ``names`` (of ``shapes``) back to back, on
        ``device`` (where :meth:`load_named_state` puts its state; default: its argument)."""
        layout, lo = [], 0
        for n, s in zip(names, shapes):
            size = math.prod(s)
            layout.append((n, lo, lo + size, torch.Size(s)))
            lo += size
        self._layout[key] = layout
        self._device[key] = device

    def prime(self, key: str, like: torch.Tensor) -> None:
        """Seeds the rule's state of ``key`` now (where it would otherwise be seeded at its
        first :meth:`compensate`, possibly on another thread)."""
        if self.rule.buffers and key not in self.rule.state:
            self.rule._buffers(key, like)

    def replace_rule(self, rule: LocalRule) -> None:
        """Continue with ``rule`` (new hyper-parameters of the same kind of rule: its
        buffers and step counts carry over; another kind: its state starts empty)."""
        if rule.name == self.rule.name:
            rule.state, rule.steps = self.rule.state, self.rule.steps
        rule.density = self.rule.density
        rule.seed = self._seed_key
        self.rule = rule

    def set_density(self, density: float) -> None:
        """The density in force (the recipe's warm-up stage), for the local rule, whose
        ``"auto"`` masking depends on it. Called by the scheme where the stage changes
        (a planned scheme's ``enter_stage``, a whole-gradient scheme's step); the memory
        owns its rule, so the rule is told nowhere else."""
        self.rule.density = float(density)

    def acc_dtype(self, grad_dtype: torch.dtype) -> torch.dtype:
        return self.dtype if self.dtype is not None else grad_dtype

    # ------------------------------------------------------------------ step
    def compensate(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """``residual + rule(grad)``: the tensor to select from (a new flat tensor, in the
        accumulation dtype; the residual's storage is reused)."""
        flat = grad.reshape(-1)
        want = self.acc_dtype(flat.dtype)
        if flat.dtype != want:
            flat = flat.to(want)
        r = self.residuals.get(key)
        if r is not None and (r.shape != flat.shape or r.dtype != flat.dtype):
            raise ValueError(f"residual {key!r} is {tuple(r.shape)} {r.dtype}, gradient "
                             f"is {tuple(flat.shape)} {flat.dtype}")
        x = self.rule.apply(key, flat)
        if r is None:  # a new tensor: update() takes it over as the residual
            return x.clone()
        return r.add_(x)  # reuse the residual's storage: it is replaced in update()

    def compensate_keyed(self, key: str, grads: Sequence[torch.Tensor], scales,
                         out: torch.Tensor) -> torch.Tensor:
        """:meth:`compensate` for a fusion group's gradients, one tensor per entry of
        ``scales`` (``Recipe.step_scales``; their concatenation, read where they lie), with
        the selection key of the pending step written into ``out`` (``ops.ef_step_key``: one
        pass on the CPU). Returns the sum (the residual's storage, which :meth:`update`
        replaces), as :meth:`compensate` does."""
        want = self.acc_dtype(grads[0].dtype)
        n = sum(g.numel() for g in grads)
        r = self.residuals.get(key)
        if r is not None and (r.numel() != n or r.dtype != want):
            raise ValueError(f"residual {key!r} is {tuple(r.shape)} {r.dtype}, gradient "
                             f"is ({n},) {want}")
        if self.rule.buffers or type(self.rule).apply is not LocalRule.apply:  # its update first
            flat = torch.cat([g.reshape(-1).to(want) for g in grads])
            grads = list(self.rule.apply(key, flat).split([g.numel() for g in grads]))
        if r is None:  # -0.0: adding it changes nothing, so the first sum is the input, bit for bit
            r = self.residuals[key] = torch.full((n,), -0.0, dtype=want, device=out.device)
        ops.ef_step_key(grads, r, scales.exp_avg_sqs, scales.bias2_sqrt, scales.eps, out,
                        root=scales.root)
        return r

    def select_steps(self, key: str, grads: Sequence[torch.Tensor], scales, out: torch.Tensor,
                     k: Optional[int] = None, *, offsets=None, ks=None,
                     wire_dtype: Optional[torch.dtype] = None):
        """:meth:`select_topk` by the pending step instead of the magnitude
        (``docs/recipe.md``, "Selecting by the step"): :meth:`compensate_keyed` (the key into
        ``out``), the same budgets on the key (``ops.keyed_topk``: one ``k``, ``ks`` per
        segment, or ``k`` over the segments with ``ks`` as floors), then :meth:`update`. The
        values are the sums', the residual as the fused kernels leave it. Returns
        ``(values, indices)``."""
        acc = self.compensate_keyed(key, grads, scales, out)
        indices = ops.keyed_topk(out, k, offsets, ks)
        values = acc.index_select(0, indices.long())
        self.update(key, acc, indices, wire_dtype)
        return values, indices

    def select_topk(self, key: str, grad: torch.Tensor, k: Optional[int] = None, *,
                    offsets=None, ks=None, wire_dtype: Optional[torch.dtype] = None):
        """:meth:`compensate`, an exact top-k and :meth:`update` as one fused kernel
        (``ops.ef_topk``; with ``offsets``/``ks``, ``ops.segmented_ef_topk``; with both and
        ``k``, ``ops.group_ef_topk``: ``k`` over the segments, ``ks`` their floors): the
        residual plus the rule's update of ``grad`` is selected from and becomes the new
        residual. Same values, indices and state as the three calls. Returns
        ``(values, indices)`` (values in the accumulation dtype)."""
        flat = grad.reshape(-1)
        want = self.acc_dtype(flat.dtype)
        r = self.residuals.get(key)
        # checked before the rule's state moves on
        if r is not None and (r.shape != flat.shape or r.dtype != want):
            raise ValueError(f"residual {key!r} is {tuple(r.shape)} {r.dtype}, gradient "
                             f"is {tuple(flat.shape)} {want}")
        if offsets is None and (k is None or not 0 <= int(k) <= flat.numel()):
            raise ValueError(f"select_topk: k={k} out of range [0, {flat.numel()}]")
        if self.rule.buffers or (flat.dtype != want and want != torch.float32):
            flat = flat.to(want)  # the rule's state lives in the accumulation dtype
        # (a float32 accumulation takes 16-bit gradients as they are: the kernel widens them)
        velocity = self._in_kernel(key, flat)
        if velocity is None:
            flat = self.rule.apply(key, flat)
            velocity = {}
        if r is None:  # -0.0: adding it changes nothing, so the first sum is the input, bit for bit
            r = self.residuals[key] = torch.full((flat.numel(),), -0.0, dtype=want,
                                                 device=flat.device)
        wire = want if wire_dtype is None else wire_dtype
        values, indices = _fused_select(flat, r, k, offsets, ks, wire, velocity)
        if velocity:  # the kernel took the step: counted now that it has (a bad argument
            self.rule.steps[key] = self.rule.steps.get(key, 0) + 1  # left u as it was)
        elif self.rule.buffers:  # only rules with state look at what was sent
            self.rule.mask(key, indices.long())
        return values, indices

    def _in_kernel(self, key: str, like: torch.Tensor) -> Optional[dict]:
        """The fused kernels' arguments that take this step's rule inside them (like: the
        flat update's dtype, device and size): {} for a rule without state (the gradient
        itself, the base :meth:`LocalRule.apply`), DGC's velocity step when
        ``fused_velocity`` offers it; None when the rule's ``apply`` (and ``mask``) must run
        outside."""
        if not self.rule.buffers and type(self.rule).apply is LocalRule.apply:
            return {}
        fused = self.rule.fused_velocity(key, like)
        if fused is None:
            return None
        u, m, masks = fused
        return {"velocity": u, "momentum": m, "mask_velocity": masks}

    def select_topk_tensors(self, key: str, grads: Sequence[torch.Tensor], k: Optional[int] = None,
                            *, offsets=None, ks=None, wire_dtype: Optional[torch.dtype] = None):
        """:meth:`select_topk` for the concatenation of ``grads`` (a fusion buffer's
        gradients, back to back; with ``offsets``/``ks`` one tensor per segment), reading them
        where they lie (``ops.ef_topk`` / ``ops.segmented_ef_topk`` / ``ops.group_ef_topk``
        with a list) instead of from a staged copy. Returns ``(values, indices)``, or None,
        having changed nothing,
        where that does not apply: no residual yet (the first step creates it), no native
        kernel for their device (the CPU has one), gradients of different dtypes or devices,
        a rule whose update is not taken inside the kernel (only momentum's velocity step
        is), or a gradient dtype the rule's state does not have; the caller then stages the
        gradients and calls :meth:`select_topk`."""
        r = self.residuals.get(key)
        op = "ef_topk_tensors" if offsets is None else "segmented_ef_topk_tensors"
        if r is None or not grads or not ops.has_native(op, r):
            return None
        dtype, device = grads[0].dtype, grads[0].device
        if dtype not in ops.VALUE_DTYPES:  # select_topk's staged path says what is wrong
            return None
        want = self.acc_dtype(dtype)
        if (r.dtype != want or r.numel() != sum(g.numel() for g in grads)
                or any(g.dtype != dtype or g.device != device for g in grads)
                or device != r.device):
            return None
        if dtype != want and (self.rule.buffers or want != torch.float32):
            return None  # select_topk converts these first
        velocity = self._in_kernel(key, r)  # the residual: the update's dtype, device, size
        if velocity is None:
            return None
        wire = want if wire_dtype is None else wire_dtype
        values, indices = _fused_select(list(grads), r, k, offsets, ks, wire, velocity)
        if velocity:  # the kernel took the step: counted now that it has
            self.rule.steps[key] = self.rule.steps.get(key, 0) + 1
        return values, indices

    def update(self, key: str, acc: torch.Tensor, indices: torch.Tensor,
               wire_dtype: Optional[torch.dtype] = None) -> None:
        """After sending ``acc[indices]`` rounded to ``wire_dtype``: the residual is ``acc``
        minus what was sent (``acc`` is taken over, not copied)."""
        idx = indices.long()
        if wire_dtype is not None and wire_dtype != acc.dtype:
            sel = acc.index_select(0, idx)
            acc.index_copy_(0, idx, sel - sel.to(wire_dtype).to(acc.dtype))
        else:
            acc.index_fill_(0, idx, 0)
        self.residuals[key] = acc
        self.rule.mask(key, idx)

    def set_residual(self, key: str, residual: torch.Tensor, sent: torch.Tensor) -> None:
        """For schemes that compute the residual themselves (SparDL's global residual
        collection): store it and mask the rule's state at ``sent``."""
        self.residuals[key] = residual
        self.rule.mask(key, sent.long())

    def sent_waits(self, key: str, indices: torch.Tensor) -> torch.Tensor:
        """How many steps of gradient each of ``indices`` carries as this rank sends it:
        the steps since this rank last sent it (1 when it was sent the step before), int32,
        on the indices' device; from now on they wait again. Call once per selection of
        ``key``, after it (its residual exists then). An element never sent has waited
        since the key's first call, or since the checkpoint it was loaded from said.

        This is each sender's own wait, which the shared moments need for SGD's momentum
        on more than two ranks (``docs/design.md``, "Each sender's wait"); the union's age
        that every receiver can compute is the shortest of them."""
        clock = self.clock[key] = self.clock.get(key, 0) + 1
        last = self.sent_at.get(key)
        if last is None:  # (the key's size: its layout, or its residual)
            layout = self._layout.get(key)
            n = layout[-1][2] if layout else self.residuals[key].numel()
            last = self.sent_at[key] = torch.zeros(n, dtype=torch.int32, device=indices.device)
        idx = indices.long()
        waits = clock - last.index_select(0, idx)
        last.index_fill_(0, idx, clock)
        return waits

    def add_squares(self, key: str, grads: Sequence[torch.Tensor], sums: bool = False) -> None:
        """Adds this step's ``grads`` (the key's tensors, or its flat gradient), squared,
        to each element's sum since this rank last sent it: what :meth:`sent_spreads`
        reads (``sums``: the gradients too, for :meth:`window_variances`). One foreach
        pass each; the sums live in float32 on the gradients' device."""
        n = sum(g.numel() for g in grads)
        flats = [g.reshape(-1) for g in grads]
        if any(g.dtype != torch.float32 for g in flats):
            flats = [g.float() for g in flats]
        for store, on in ((self.squares, True), (self.sums, sums)):
            if not on:
                continue
            acc = store.get(key)
            if acc is None or acc.numel() != n:
                acc = store[key] = torch.zeros(n, dtype=torch.float32, device=grads[0].device)
            parts = list(acc.split([g.numel() for g in flats])) if len(flats) > 1 else [acc]
            if store is self.squares:
                torch._foreach_addcmul_(parts, flats, flats)
            else:
                torch._foreach_add_(parts, flats)

    def window_variances(self, key: str, indices: torch.Tensor, waits: torch.Tensor) -> torch.Tensor:
        """Per element of ``indices``, the variance of this rank's gradient over the ``waits``
        steps of its window, ``Σg²/w − (Σg/w)²`` (float32; the sums of :meth:`add_squares`
        with ``sums``), for a scheme whose arrivals are not one rank's sums (SparDL's
        merged partial sums); the window starts again there."""
        idx = indices.long()
        q = self.squares[key].index_select(0, idx)
        s = self.sums[key].index_select(0, idx)
        self.squares[key].index_fill_(0, idx, 0.0)
        self.sums[key].index_fill_(0, idx, 0.0)
        w = waits.to(q.device, torch.float32)
        return q.div_(w).sub_(s.div_(w).square_()).clamp_(min=0.0)

    def sent_spreads(self, key: str, indices: torch.Tensor, values: torch.Tensor,
                     waits: torch.Tensor) -> torch.Tensor:
        """Per entry this rank sends (``values``, the sums of ``waits`` steps of its
        gradient), the variance of that gradient over those steps as a ratio to the value
        squared, ``Σg²/(w·S²) − 1/w²`` (0 where it waited one step or the value is 0;
        float32); the sums of squares start again there. Call after :meth:`add_squares`
        of this step and :meth:`sent_waits` of this selection. The shared moments add the
        senders' variance to Adam's second moment (``docs/recipe.md``, "The senders'
        variance")."""
        idx = indices.long()
        sq = self.squares[key]
        q = sq.index_select(0, idx)
        sq.index_fill_(0, idx, 0.0)
        w = waits.to(q.device, torch.float32)
        s2 = values.to(q.device, torch.float32).square()
        spread = q.div_(w * s2).sub_(w.square().reciprocal()).clamp_(min=0.0)
        return torch.where(s2 > 0, spread, torch.zeros_like(spread))

    # ------------------------------------------------------------------ step transaction
    def _live(self):
        """Every state tensor, keyed ``(store, key)``: residuals, the rule's buffers and the
        send clocks."""
        out = {("residual", k): t for k, t in self.residuals.items()}
        out.update({("sent_at", k): t for k, t in self.sent_at.items()})
        out.update({("squares", k): t for k, t in self.squares.items()})
        out.update({("sums", k): t for k, t in self.sums.items()})
        for key, st in self.rule.state.items():
            out.update({(b, key): t for b, t in st.items()})
        return out

    def checkpoint(self) -> None:
        """Remembers the state as it is now, before a step changes it, so that
        :meth:`restore` can put it back bit for bit (a step whose synchronized gradients are
        not finite never happened). One copy of every state tensor into buffers kept from
        step to step (allocated again only when a plan's stage changes their shapes)."""
        live = self._live()
        src, dst = [], []
        for name, t in live.items():
            sh = self._shadow.get(name)
            if sh is None or sh.shape != t.shape or sh.dtype != t.dtype or sh.device != t.device:
                sh = self._shadow[name] = torch.empty_like(t)
            src.append(t)
            dst.append(sh)
        for name in set(self._shadow) - set(live):
            del self._shadow[name]
        if src:
            with torch.no_grad():
                torch._foreach_copy_(dst, src)
        self._saved = (dict(self.residuals), {k: dict(st) for k, st in self.rule.state.items()},
                       dict(self.rule.steps), dict(self.sent_at), dict(self.clock),
                       dict(self.squares), dict(self.sums), live)

    def restore(self) -> None:
        """Back to the last :meth:`checkpoint` (valid until the next one, so a step can
        still be undone after it finished): the same tensors (a step may have replaced
        some) holding the same values; keys a step created are gone."""
        if self._saved is None:
            return
        residuals, state, steps, sent_at, clock, squares, sums, live = self._saved
        names = list(live)
        if names:
            with torch.no_grad():
                torch._foreach_copy_([live[n] for n in names], [self._shadow[n] for n in names])
        self.residuals, self.rule.state, self.rule.steps = residuals, state, steps
        self.sent_at, self.clock, self.squares, self.sums = sent_at, clock, squares, sums
        self._saved = None  # (once: the shadows are the state now)

    def rescale(self, c) -> None:
        """The state as it would be had every gradient so far been ``c`` times what it was
        (``c``: a number or a one-element tensor; a loss scale's inverse, a power of two, so
        this is exact): each tensor times ``c ** power`` (:attr:`LocalRule.units`)."""
        by_power: Dict[int, List[torch.Tensor]] = {}
        for (store, _), t in self._live().items():
            power = {"sent_at": 0, "squares": 2, "sums": 1}.get(store, self.rule.units.get(store, 1))
            if power:
                by_power.setdefault(power, []).append(t)
        with torch.no_grad():
            for power, tensors in by_power.items():
                torch._foreach_mul_(tensors, c if power == 1 else c ** power)

    # ------------------------------------------------------------------ state
    def named_state(self) -> dict:
        """Residuals and rule buffers split per parameter name (clones), plus the rule's
        step count per name, and where a key keeps them, each element's wait so far
        (:meth:`sent_waits`) and sum of squares (:meth:`add_squares`); only keys given to
        :meth:`register` are saved."""
        out = {"rule": self.rule.name, "residuals": {}, "steps": {}, "waits": {}, "squares": {},
               "sums": {}}
        for b in self.rule.buffers:
            out[b] = {}
        for key, layout in self._layout.items():
            if key in self.sent_at:  # a wait is the clock's distance from the last send
                waited = self.clock[key] - self.sent_at[key]
                for name, lo, hi, shape in layout:
                    out["waits"][name] = waited[lo:hi].view(shape).clone()
            stores = [("residuals", self.residuals.get(key)), ("squares", self.squares.get(key)),
                      ("sums", self.sums.get(key))]
            stores += [(b, self.rule.state.get(key, {}).get(b)) for b in self.rule.buffers]
            for store, flat in stores:
                if flat is None:
                    continue
                for name, lo, hi, shape in layout:
                    out[store][name] = flat[lo:hi].view(shape).clone()
            if key in self.rule.steps:
                for name, *_ in layout:
                    out["steps"][name] = self.rule.steps[key]
        return out

    def rule_views(self):
        """``(name, {buffer: view}, steps)`` for every registered tensor whose rule state
        exists: views into the flat buffers, shaped like the tensor (no copies)."""
        for key, layout in self._layout.items():
            st = self.rule.state.get(key)
            if not st or not all(b in st for b in self.rule.buffers):
                continue
            steps = self.rule.steps.get(key, 0)
            for name, lo, hi, shape in layout:
                yield name, {b: st[b][lo:hi].view(shape) for b in self.rule.buffers}, steps

    def load_named_state(self, state: dict, device: torch.device) -> None:
        """Inverse of :meth:`named_state` for the registered keys. A key none of whose
        tensors is in ``state`` starts empty (zero residual, fresh rule state); one with
        only some of them is an error (state would be lost)."""
        if state.get("rule", self.rule.name) != self.rule.name:
            raise ValueError(f"checkpoint accumulates {state.get('rule')!r} locally, this "
                             f"optimizer {self.rule.name!r} (see momentum_correction)")
        self.residuals = {}
        self.rule.state, self.rule.steps = {}, {}
        self.sent_at, self.clock, self.squares, self.sums = {}, {}, {}, {}
        for key, layout in self._layout.items():
            names = [n for n, *_ in layout]
            dev = self._device.get(key) or device

            def joined(store):
                have = state.get(store) or {}
                present = [n for n in names if n in have]
                if not present:
                    return None
                if len(present) != len(names):
                    missing = [n for n in names if n not in have]
                    raise ValueError(f"checkpoint has no {store} for {missing[:5]} (but has "
                                     f"them for {present[:3]}): it does not match this model")
                return torch.cat([have[n].reshape(-1) for n in names])

            r = joined("residuals")
            if r is not None:
                self.residuals[key] = r.to(dev, self.acc_dtype(r.dtype))
                w = joined("waits")  # (they go with the residuals they describe)
                if w is not None:
                    self.clock[key] = 0
                    self.sent_at[key] = w.to(dev, torch.int32).neg_()
                for store, into in (("squares", self.squares), ("sums", self.sums)):
                    q = joined(store)
                    if q is not None:
                        into[key] = q.to(dev, torch.float32)
            bufs = {b: joined(b) for b in self.rule.buffers}
            if self.rule.buffers and all(v is not None for v in bufs.values()):
                self.rule.state[key] = {b: v.to(dev, self.acc_dtype(v.dtype))
                                        for b, v in bufs.items()}
                steps = state.get("steps", {})
                if names[0] in steps:
                    self.rule.steps[key] = int(steps[names[0]])
