"""What an optimizer of ours saves, loads and receives: ``state_dict()``,
``load_state_dict()`` and the adoption of a state that ``hvd.broadcast_optimizer_state``
carried from the root (one owner of that protocol; the optimizer's class takes these
methods, :class:`CheckpointState`).

* A checkpoint loads anywhere: ``state_dict()`` writes each sparsified tensor's real
  optimizer state (the local rules' buffers) where torch keeps it, plus our ``"ssfusion"``
  entry (the scheme's state: plan, iteration, residuals; the shared moments' ages).
* The broadcast: Horovod broadcasts every param-group option, so the root's shared scheme
  state travels as one (``_SHARED_KEY``) and every rank adopts it at its next hook
  (:meth:`CheckpointState._adopt_broadcast`), after one ``Min`` allreduce that tells them
  whether all of them keep their own state.
"""
from __future__ import annotations

import warnings

import torch

from .core.transport import Min
from .recipe import _zero_step, resolve_recipe

__all__ = ["CheckpointState"]

_STATE_KEY = "ssfusion"
#: the param-group option through which ``hvd.broadcast_optimizer_state`` carries the
#: root's shared scheme state to every rank (see ``CheckpointState.state_dict``)
_SHARED_KEY = "ssfusion_shared"


def _step_tensor(steps: int, p: torch.Tensor, group: dict) -> torch.Tensor:
    """Adam's step count ``steps`` in the form ``torch.optim.Adam`` keeps it."""
    return _zero_step(None, p, group).fill_(steps)


def _same(a, b) -> bool:
    """Deep equality of plain values and tensors (shared scheme states)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


class CheckpointState:
    """The state methods of ``_DistributedOptimizer`` (``DistributedOptimizer`` builds the
    optimizer's class from both; ``super(self.__class__, self)`` is the wrapped
    optimizer's class there)."""

    def state_dict(self):
        """The wrapped optimizer's state dict plus ``"ssfusion"``: this rank's scheme state
        (plan, iteration, residuals, the local rule's buffers). Residuals differ per rank:
        every rank that should resume exactly saves its own (docs/horovod.md, "Checkpoint and resume")."""
        if not self._submitted:
            self._follow_world()
        broadcast = self._in_broadcast()
        if broadcast:
            self._mirror_into_live()
        state = super(self.__class__, self).state_dict()
        if not broadcast:
            self._real_state(state)
        for g in state["param_groups"]:
            g.pop(_SHARED_KEY, None)
        if state["param_groups"] and broadcast:
            # hvd.broadcast_optimizer_state broadcasts every param-group option from the
            # root and assigns it on every rank: the root's shared scheme state travels
            # with it and is adopted before the next collective (_adopt_broadcast)
            state["param_groups"][0][_SHARED_KEY] = self._shared_state()
        state[_STATE_KEY] = {"scheme": self._scheme_name, "state": self._scheme.state_dict(),
                             "size": self._world[0] if self._world else None}
        shared = self._config.recipe.shared
        if shared is not None:  # the same on every rank, like the state it moves
            state[_STATE_KEY]["ages"] = shared.state_dict(self._config.names)
        return state

    def _rule_states(self):
        """``(parameter, {buffer: tensor}, steps)`` of every tensor whose optimizer state a
        local rule owns (views into the rules' buffers), in torch's names: SGD's
        ``momentum_buffer`` (the DGC velocity is one), Adam's ``exp_avg``, ``exp_avg_sq``."""
        if not self._config.recipe.owns_state() or not self._scheme.stateful:
            return
        by_name = {n: p for p, n in self._config.names.items()}
        for mem in self._scheme.memories():
            for name, views, steps in mem.rule_views():
                yield by_name[name], views, steps

    def _torch_entry(self, p, views, steps, into=None) -> dict:
        """The wrapped optimizer's state entry of ``p`` holding the rule's state: written
        into the tensors of ``into`` (the live entry) where their shapes match, else new
        tensors in ``p``'s dtype."""
        entry = {} if into is None else into
        for b, v in views.items():
            t = entry.get(b)
            if isinstance(t, torch.Tensor) and t.shape == v.shape:
                t.copy_(v)
            else:
                entry[b] = v.to(p.dtype).clone(memory_format=torch.preserve_format)
        if self._config.recipe.kind == "adam":
            old = entry.get("step")
            if isinstance(old, torch.Tensor):
                old.fill_(steps)
            else:
                entry["step"] = _step_tensor(steps, p, self.param_groups[self._group_index[p]])
        return entry

    def _real_state(self, state: dict) -> None:
        """``state`` (torch's state dict of the wrapped optimizer) with each sparsified
        tensor's entry holding its rule's state instead of the placeholders: a checkpoint
        that loads into any torch optimizer, Horovod's, or ours with another scheme. New
        entries; the live state keeps its placeholders (nothing stale for a later step)."""
        # torch numbers the parameters across the groups, in order
        index = {id(p): i for i, p in enumerate(q for g in self.param_groups for q in g["params"])}
        with torch.no_grad():
            for p, views, steps in self._rule_states():
                k = index[id(p)]
                live = state["state"].get(k, {})
                fresh = {b: v for b, v in live.items() if b not in views and b != "step"}
                state["state"][k] = self._torch_entry(p, views, steps, into=fresh)

    def _mirror_into_live(self) -> None:
        """During ``hvd.broadcast_optimizer_state``: the rules' state written into the live
        entries, which Horovod broadcasts from the root and into on the other ranks (it
        broadcasts into the tensors ``state_dict()`` returns). A rank that starts its rules
        afresh then takes the root's buffers from there (``Recipe.take_state``), not zeros;
        a rank that keeps its own puts the placeholders back (:meth:`_zero_owned`)."""
        with torch.no_grad():
            for p, views, steps in self._rule_states():
                self._torch_entry(p, views, steps, into=self.state[p])

    def _zero_owned(self) -> None:
        """The placeholders back in the live entries of the tensors the rules own."""
        with torch.no_grad():
            for p, views, _ in self._rule_states():
                st = self.state.get(p, {})
                for b in list(views) + ["step"]:
                    if isinstance(st.get(b), torch.Tensor):
                        st[b].zero_()

    def _shared_state(self) -> dict:
        recipe = self._config.recipe
        return {"scheme": self._scheme_name, "recipe": (recipe.kind, recipe.hparams, recipe.moments),
                "state": self._scheme.shared_state()}

    def _adopt_broadcast(self) -> None:
        """After ``hvd.broadcast_optimizer_state``: continue from the root's shared state
        (plan, iteration, ...) and re-resolve the recipe from the broadcast
        hyper-parameters. Every rank of the process set gets here at its next
        ``synchronize()`` (or first backward hook), so the one collective below, which
        tells every rank whether all of them keep their own state, runs on all of them."""
        shared = None
        for g in self.param_groups:
            shared = g.pop(_SHARED_KEY, shared)
        if shared is None or not self._config.process_set.included():
            return
        if self._model_check is not None:
            # Horovod elastic: the model check runs at every adoption, on every rank (a rank
            # that joined has not run it yet, and every rank of the new world gets here
            # together, at its first synchronization after the reset's broadcast)
            self._model_check()
        # (every rank runs the same scheme and options: checked when it was built)
        keep = self._adopt_recipe() and _same(self._shared_state(), shared)
        # every rank of the set runs this one collective, then all decide alike
        tr = self._transport
        flag = torch.tensor([int(keep)], dtype=torch.int32)
        all_keep = bool(tr.wait(tr.allreduce(flag, "adopt", op=Min)).item())
        self._scheme.adopt_shared(shared["state"], keep, all_keep)
        if not all_keep and self._config.recipe.shared is not None:
            # a rank that did not keep its residuals has no ages that match them: every
            # rank starts its ages afresh, so that all of them move the state alike
            self._config.recipe.shared.reset()
        if keep:  # its rules keep their state: what the broadcast wrote is not theirs
            self._zero_owned()

    def _adopt_recipe(self) -> bool:
        """Re-resolves the recipe from the (broadcast) hyper-parameters; the local rules
        continue with them. False when the kind of local rule changed (its state is then
        not this rank's to keep)."""
        old = self._config.recipe
        recipe = resolve_recipe(self, **old.options) if old.options is not None else old
        if (recipe.kind, recipe.hparams, recipe.moments) != (old.kind, old.hparams, old.moments):
            # the broadcast replaced this rank's hyper-parameters with the root's: the
            # local rules continue with them (their buffers too, if of the same kind)
            recipe.bind(self, self._config.names)
            if recipe.shared is not None and old.shared is not None and recipe.kind == old.kind:
                recipe.shared.ages = old.shared.ages
            self._config.recipe = recipe
            for mem in self._scheme.memories():
                mem.replace_rule(recipe.make_rule())
                mem.seed_from = recipe.take_state
        return (recipe.kind, recipe.moments) == (old.kind, old.moments)

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        if any(_SHARED_KEY in g for g in state_dict.get("param_groups", ())):
            state_dict["param_groups"] = [{k: v for k, v in g.items() if k != _SHARED_KEY}
                                          for g in state_dict["param_groups"]]
        ours = state_dict.pop(_STATE_KEY, None)
        self._follow_world()
        size = self._world[0] if self._world else None
        # The optimizer state itself is in the torch entries (state_dict() writes the rules'
        # buffers there), where this scheme's rules pick it up. What only the writer's
        # scheme, or a job of its size, could use (its plan, residuals, ZEN's hashing,
        # SparDL's teams) is left behind.
        foreign = None
        if ours is not None and ours["scheme"] != self._scheme_name:
            foreign = (f"written by scheme {ours['scheme']!r}, this optimizer runs "
                       f"{self._scheme_name!r}")
        elif ours is not None and ours.get("size") not in (None, size):
            foreign = f"written by a job of {ours['size']} ranks, this one has {size}"
        if foreign is not None:
            if self._config.process_set.included() and self._transport.rank == 0:
                warnings.warn(f"ssfusion_hvd: the checkpoint was {foreign}: the optimizer "
                              f"state carries over, the scheme's residuals and plan do not "
                              f"(a planned scheme profiles and plans again)", stacklevel=2)
            ours = None
        self._drop_step()
        super(self.__class__, self).load_state_dict(state_dict)
        if ours is not None:
            self._scheme.load_state_dict(ours["state"])
        if self._config.recipe.shared is not None:
            self._config.recipe.shared.load_state_dict(ours and ours.get("ages"), self._config.names)
