"""The scheme for the world as it is (one owner; the optimizer's class takes these methods,
:class:`SchemeWorld`). A rank outside the process set builds no scheme and no transport;
under Horovod elastic the world may change at a reset, and every rank of the new world
rebuilds its scheme at the same call (``docs/horovod.md``, "Elastic training").
"""
from __future__ import annotations

import torch

from .core.transport import Transport, numbered_as
from .registry import SCHEMES
from .schemes import OutsideTheSet

__all__ = ["SchemeWorld"]


def _world(process_set):
    """``(size, rank)`` of ``process_set`` as this rank sees it (rank None outside the
    set); None once Horovod is shut down (a checkpoint saved after the job)."""
    try:
        return process_set.size(), (process_set.rank() if process_set.included() else None)
    except ValueError:
        return None


class SchemeWorld:
    """Mixed into our optimizers' classes (``optimizer._METHODS``)."""

    def _build_scheme(self, tag=None) -> None:
        """The scheme for the process set as it is now. A rank outside the set makes no
        collective and steps on its own gradients, as under Horovod's optimizer: it builds
        no scheme and no transport. ``tag``: the name of the transport being replaced."""
        config = self._config
        with numbered_as(tag):
            self._scheme = (SCHEMES[self._scheme_name].load() if config.process_set.included()
                            else OutsideTheSet)(config)
        self._scheme.keep_step = self._keep_step
        self._world = _world(config.process_set)

    def _follow_world(self) -> None:
        """Horovod elastic: after a reset the process set may have another size (ranks
        left or joined) and this rank another rank. Every rank of the new world sees that
        at the same call (the first ``state_dict``, ``load_state_dict``, backward hook or
        ``synchronize()`` after the reset) and rebuilds its scheme for it: the planned
        schemes profile and plan again, ExDyna calibrates again, and every rank starts
        with empty residuals, which is what a rank that joined has. The optimizer state
        carries over: the wrapped optimizer's (shared moments' too), and the local rules'
        through the torch entries their new buffers start from (docs/horovod.md,
        "Elastic training")."""
        world = _world(self._config.process_set)
        if world is None or world == self._world:
            return
        old = self._scheme
        with torch.no_grad():
            self._mirror_into_live()  # the local rules' state, where the new ones start from
        old.close()
        self._drop_step()
        self._build_scheme(getattr(getattr(old, "transport", None), "tag", None))
        if self._transport is not None:
            with numbered_as(self._transport.tag):
                self._transport = self._agreement.transport = Transport(self._config,
                                                                        "ssfusion.check.")
        if self._config.recipe.shared is not None:
            self._config.recipe.shared.reset()  # the ages went with the residuals

    def _drop_step(self) -> None:
        """Forgets the step in flight (a checkpoint load, a rebuilt scheme)."""
        self._scheme.reset()
        self._agreement.reset()
        self._in_step = False
        self._step_undone = True  # (no step to undo: the state is what was loaded)
        self._config.recipe.journal = self._journal = None
        self._submitted.clear()
        self._synchronized = False
        self._should_synchronize = True
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step
