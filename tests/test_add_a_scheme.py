"""Adding a scheme touches one file: a random-k scheme with error feedback, written here
against the scheme interface (``WholeGradientScheme``) and registered with
``ssfusion_hvd.register_scheme``, runs under ``scheme="randomk_example"`` on real Horovod
workers: its synchronized gradients equal a reference rebuilt from every rank's inputs,
the ranks stay identical, and the rest of the optimizer (the step agreement, the
non-finite flags, stats) comes with it. The workers import this module, so they register
the scheme as the test process does."""
import time

import torch

import ssfusion_hvd
from ssfusion_hvd.schemes import WholeGradientScheme


class RandomKScheme(WholeGradientScheme):
    """Random-k: every rank draws the same k indices of the flat gradient (a generator
    seeded by the step), adds its residual and sends the values there by one allreduce;
    what was not drawn stays in the residual."""

    name = "randomk_example"
    prefix = "rk"

    def __init__(self, config):
        super().__init__(config)
        self.reset()

    def _launch(self) -> None:
        t0 = time.perf_counter()
        acc = self._memory.compensate(self._KEY, self._flat_grad())
        k = max(1, round(self._density() * acc.numel()))
        gen = torch.Generator().manual_seed(self._iteration)
        self._idx = torch.randperm(acc.numel(), generator=gen)[:k].to(acc.device)
        self._acc = acc
        pre, post = self.transport.horovod_scales()
        self._handle = self.transport.allreduce(acc[self._idx].to(self._dtype), "values",
                                                prescale=pre, postscale=post)
        self._sparsify_s = time.perf_counter() - t0

    def finish(self) -> None:
        if self._handle is None:
            return
        t_wait = time.perf_counter()
        values = self.transport.wait(self._handle)
        out = torch.zeros_like(self._acc)
        out[self._idx] = values.to(out.dtype)
        self._deliver(out)
        self._memory.update(self._KEY, self._acc, self._idx, self._dtype)
        self._finished()
        self.last_stats = self._step_stats(
            t_wait, time.perf_counter(), elements_sent=self._idx.numel(),
            allreduce_bytes=self.transport.sent["allreduce"],
            density_target=self._density(), sparsify_s=self._sparsify_s)
        self.reset()

    def pending(self) -> bool:
        return self._submitted > 0 or self._handle is not None

    def reset(self) -> None:
        super().reset()
        self._handle = self._idx = self._acc = None


ssfusion_hvd.register_scheme(RandomKScheme, "random-k with error feedback (an example)")

DENSITY, STEPS = 0.05, 6


def train(steps=STEPS):
    """One worker: a small MLP, plain SGD, the example scheme; each step's own flat
    gradient (before synchronize) and the synchronized one."""
    import horovod.torch as hvd

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = ssfusion_hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
        scheme="randomk_example", density=DENSITY, density_warmup_steps=0)
    names = sorted(n for n, _ in model.named_parameters())  # the scheme's canonical order
    params = dict(model.named_parameters())
    flat = lambda: torch.cat([params[n].grad.reshape(-1) for n in names]).clone()  # noqa: E731
    gen = torch.Generator().manual_seed(100 + hvd.rank())
    own, synced, stats = [], [], []
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        own.append(flat())
        opt.synchronize()
        synced.append(flat())
        with opt.skip_synchronize():
            opt.step()
        stats.append(opt.stats())
    return {"own": own, "synced": synced, "stats": stats,
            "params": {n: p.detach().clone() for n, p in params.items()}}


def test_a_scheme_written_in_a_test_file_runs_on_real_workers():
    from hvdrun import run_workers

    assert "randomk_example" in ssfusion_hvd.SCHEMES
    ranks = run_workers(train, np=2, timeout=180)
    n = ranks[0]["own"][0].numel()
    k = max(1, round(DENSITY * n))
    residuals = [torch.zeros(n) for _ in ranks]
    for step in range(STEPS):
        idx = torch.randperm(n, generator=torch.Generator().manual_seed(step))[:k]
        acc = [res + r["own"][step] for res, r in zip(residuals, ranks)]
        want = torch.zeros(n)
        want[idx] = sum(a[idx] for a in acc) / len(ranks)
        for a in acc:
            a[idx] = 0
        residuals = acc
        for r in ranks:
            torch.testing.assert_close(r["synced"][step], want, rtol=1e-6, atol=1e-7)
            st = r["stats"][step]
            assert st["elements_sent"] == k and st["phase"] == "sparse" and not st["skipped"]
    for name, p in ranks[0]["params"].items():
        assert torch.equal(p, ranks[1]["params"][name]), name
