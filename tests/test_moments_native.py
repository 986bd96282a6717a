"""The shared-moments step's native kernel (csrc/moments.h; CPU, and CUDA on a GPU machine)
against the foreach path it replaced and against each other. No Horovod: these run on a
GPU machine before Horovod is built (scripts/gpu_e2e.sh)."""
import pytest
import torch

from ssfusion_hvd.moments import SharedMoments


def _moment_case(kind, nesterov, device="cpu"):
    """Three tensors (one larger than a CUDA launch batch row covers), their gradients with
    a third of the elements not arrived (zero), ages 0-9, and the optimizer's state after
    one step."""
    g = torch.Generator().manual_seed(5)
    ps = [torch.nn.Parameter(torch.randn(n, generator=g).to(device)) for n in (1, 300, 70000)]
    for p in ps:
        grad = torch.randn(p.numel(), generator=g)
        grad[torch.rand(p.numel(), generator=g) < 1 / 3] = 0.0
        p.grad = grad.to(device)
    if kind == "momentum":
        opt = torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1 * (not nesterov),
                              nesterov=nesterov)
        hp = {"momentum": 0.9, "dampening": 0.1 * (not nesterov), "nesterov": nesterov}
    else:
        opt = torch.optim.Adam(ps, lr=0.01, betas=(0.9, 0.99), eps=1e-8)
        hp = {"betas": (0.9, 0.99), "eps": 1e-8}
    moments = SharedMoments(kind, hp)
    for p in ps:
        moments.ages[p] = torch.randint(0, 10, (p.numel(),), generator=g).float().to(device)
    return ps, opt, moments


@pytest.mark.parametrize("kind,nesterov", [("momentum", False), ("momentum", True), ("adam", False)])
def test_the_native_step_is_the_foreach_step(kind, nesterov, monkeypatch):
    """csrc/moments.h's one pass per tensor against the foreach path it replaces (two
    steps, so the state the first made is read): the same parameters, state and ages, to
    float32 rounding (the two round the fresh share differently: at age 1 the native one is
    exactly 1)."""
    import ssfusion_hvd.moments as mod

    if mod.native_op("shared_momentum_step", torch.zeros(1)) is None:
        pytest.skip("built without the extension")
    runs = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(mod, "native_op", lambda op, x: None)
        ps, opt, moments = _moment_case(kind, nesterov)
        for _ in range(2):
            moments.step(opt, opt.param_groups[0], ps)
        runs.append((ps, opt, moments))
    (ps, opt, mo), (ps_t, opt_t, mo_t) = runs
    start = _moment_case(kind, nesterov)[0]
    for p, q, p0 in zip(ps, ps_t, start):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
        for key, value in opt.state[p].items():
            torch.testing.assert_close(value, opt_t.state[q][key], rtol=1e-5, atol=1e-6)
        assert torch.equal(mo.ages[p], mo_t.ages[q])
        assert not torch.equal(p.detach(), p0.detach())  # it moved


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kind,nesterov", [("momentum", False), ("momentum", True), ("adam", False)])
def test_gpu_native_step_equals_the_cpu_s(kind, nesterov, monkeypatch):
    """The CUDA kernel (on, for this test: ``moments.NATIVE_ON_CUDA``) against the CPU's."""
    import ssfusion_hvd.moments as mod

    monkeypatch.setattr(mod, "NATIVE_ON_CUDA", True)
    calls = []
    native = mod.native_op
    monkeypatch.setattr(mod, "native_op", lambda op, x: calls.append(x.device.type) or native(op, x))
    out = []
    for device in ("cpu", "cuda"):
        ps, opt, moments = _moment_case(kind, nesterov, device)
        for _ in range(2):
            moments.step(opt, opt.param_groups[0], ps)
        out.append([(p.detach().cpu(), moments.ages[p].cpu()) for p in ps])
    assert "cuda" in calls and mod.native_op("shared_adam_step", torch.zeros(1, device="cuda"))
    for (p, a), (q, b) in zip(*out):
        # (nvcc contracts a·b + c into one rounding where the CPU build rounds twice)
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
        assert torch.equal(a, b)


def test_the_native_step_checks_its_tensors():
    """What the foreach path would take but the native pass cannot (another dtype, another
    size, a strided view, lists of different lengths) raises instead of writing memory it
    does not own; SharedMoments never hands it such tensors (it takes the foreach path)."""
    from ssfusion_hvd.ops import native_op

    fn = native_op("shared_momentum_step", torch.zeros(1))
    if fn is None:
        pytest.skip("built without the extension")
    ok = [torch.zeros(3)]
    for bad in ([torch.zeros(3, dtype=torch.float64)], [torch.zeros(4)], [torch.zeros(6)[::2]],
                [torch.zeros(3), torch.zeros(3)]):
        with pytest.raises(RuntimeError, match="shared_momentum_step"):
            fn(bad, ok, [torch.zeros(3)], [torch.zeros(3)], 0.1, 0.9, 0.0, False)
    p = torch.zeros(3)
    fn([p], [torch.ones(3)], [torch.zeros(3)], [torch.zeros(3)], 0.1, 0.9, 0.0, False)
    assert torch.equal(p, torch.full((3,), -0.1))  # SGD's first step: buffer = g
