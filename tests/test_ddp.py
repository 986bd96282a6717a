"""ssfusion_hvd.ddp: the engine as a DDP communication hook, on 2 and 3 gloo ranks.

Every sparse scheme's synchronized gradients equal a reference computed here from each
rank's own gradients (error feedback by hand: acc = residual + gradient, the scheme's
selection over each bucket the hook met, the average of what the ranks sent); the ranks
hold identical gradients; a resumed hook continues bit for bit; ``no_sync()``
accumulation is synchronized once; bad arguments raise on every rank before any
collective."""
import math

import numpy as np
import pytest
import torch

from ddprun import run_ddp
import workers_ddp
from ssfusion_hvd.recipe import Recipe

pytestmark = pytest.mark.multiworker

DENSITY = 0.1


def _k(n: int, density: float) -> int:
    return min(n, max(1, math.ceil(n * density - 1e-9)))


def _mask(acc, sizes, scheme, density, ks=None):
    """Which elements of one bucket's ``acc`` (its tensors back to back) are sent; ``ks``:
    each tensor's k (a plan's), else its nominal k at ``density``."""
    mask = torch.zeros(acc.numel(), dtype=torch.bool)
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    mag = acc.abs()
    if scheme == "multi_tensor":
        mask[mag.topk(_k(acc.numel(), density)).indices] = True
        return mask
    ks = ks or [_k(n, density) for n in sizes]
    if scheme == "per_tensor" or len(sizes) == 1:
        for lo, hi, k in zip(bounds, bounds[1:], ks):
            mask[lo + mag[lo:hi].topk(k).indices] = True
        return mask
    # ssfusion: each tensor its largest element, then the rest of the bucket's budget to
    # the largest of all the others
    for lo, hi in zip(bounds, bounds[1:]):
        mask[lo + mag[lo:hi].argmax()] = True
    rest = mag.masked_fill(mask, -1.0)
    mask[rest.topk(sum(ks) - len(sizes)).indices] = True
    return mask


def _planned_k(k: int, n: int, density: float, planned: float) -> int:
    """A plan's k at another density (the warm-up's stages): ``Plan.at_density``, which
    scales the tensor's share at the plan's density (a floor is not a share)."""
    share = min(k, planned * n)
    return k if density == planned else min(n, max(k, math.ceil(share * density / planned - 1e-9)))


def _reference(ranks, scheme, density, warmup=0):
    """With a plan (``ranks[0]["plan"]``: name -> (sparsified, k)), the tensors it sends
    dense are plain averages and the others are selected over their bucket with its ks."""
    schedule = Recipe("none", density, warmup, True)  # the density in force at each step
    plan = ranks[0].get("plan")
    shapes = {n: g.shape for n, g in ranks[0]["local"][0].items()}
    residual = [{n: torch.zeros(s).reshape(-1) for n, s in shapes.items()} for _ in ranks]
    out = []
    for step in range(len(ranks[0]["local"])):
        buckets = ranks[0]["buckets"][step]
        assert sorted(n for b in buckets for n in b) == sorted(shapes), buckets
        total = {n: torch.zeros(s).reshape(-1) for n, s in shapes.items()}
        for r, rec in enumerate(ranks):
            assert rec["buckets"][step] == buckets  # every rank met the same buckets
            for names in buckets:
                d = schedule.density_at(step)
                ks = None
                if plan is not None:
                    for n in names:
                        if not plan[n][0]:
                            total[n] += rec["local"][step][n].reshape(-1)
                    names = [n for n in names if plan[n][0]]
                    ks = [_planned_k(plan[n][1], shapes[n].numel(), d, density) for n in names]
                    if not names:
                        continue
                acc = torch.cat([residual[r][n] + rec["local"][step][n].reshape(-1) for n in names])
                sizes = [shapes[n].numel() for n in names]
                sent = torch.where(_mask(acc, sizes, scheme, d, ks), acc, torch.zeros(()))
                for n, lo, hi in zip(names, [0] + list(torch.tensor(sizes).cumsum(0)[:-1]),
                                     torch.tensor(sizes).cumsum(0)):
                    residual[r][n] = (acc - sent)[lo:hi]
                    total[n] += sent[lo:hi]
        out.append({n: (t / len(ranks)).view(shapes[n]) for n, t in total.items()})
    return out


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("scheme", ["per_tensor", "multi_tensor", "ssfusion"])
def test_synchronized_gradients_equal_the_reference(scheme, np_):
    ranks = run_ddp(workers_ddp.record, np=np_, scheme=scheme, density=DENSITY)
    assert len(ranks[0]["buckets"][-1]) > 1  # several buckets, as a real model has
    expect = _reference(ranks, scheme, DENSITY)
    for step, want in enumerate(expect):
        for r, rec in enumerate(ranks):
            for n, g in rec["synced"][step].items():
                assert torch.equal(g, ranks[0]["synced"][step][n]), (step, r, n)  # ranks identical
                torch.testing.assert_close(g, want[n], rtol=1e-6, atol=1e-7,
                                           msg=lambda m: f"step {step}, rank {r}, {n}: {m}")
    # a sparse step sends about DENSITY of the elements, so most synchronized ones are zero
    zeros = sum(int((g == 0).sum()) for g in ranks[0]["synced"][-1].values())
    numel = sum(g.numel() for g in ranks[0]["synced"][-1].values())
    assert zeros > (1 - np_ * DENSITY) * numel * 0.9


@pytest.mark.parametrize("scheme", ["multi_tensor", "ssfusion"])
def test_records_allgathered_in_pieces_equal_the_reference(scheme):
    """Records larger than the piece size go as several allgathers in flight (gloo's large
    messages are slow): the same gradients as the reference, on 3 ranks, several buckets,
    the last piece padded."""
    ranks = run_ddp(workers_ddp.record, np=3, scheme=scheme, density=DENSITY, piece_bytes=20)
    assert ranks[0]["pieces"] > 1
    expect = _reference(ranks, scheme, DENSITY)
    for step, want in enumerate(expect):
        for rec in ranks:
            for n, g in rec["synced"][step].items():
                assert torch.equal(g, ranks[0]["synced"][step][n])
                torch.testing.assert_close(g, want[n], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("scheme", ["per_tensor", "ssfusion"])
def test_a_plan_s_buckets_and_dense_tensors(scheme, np_):
    """With a plan (``make_plan``): DDP built with ``ddp_kwargs(plan)`` meets the plan's
    groups as its buckets from the second step on (DDP rebuilds them once); within a
    bucket the tensors the plan sends dense are averaged exactly (one allreduce beside the
    sparse part's allgather) and the others are selected with the plan's ks; ranks
    identical; the bytes sent are the records plus the dense tensors."""
    dense = ("0.bias", "4.bias", "2.weight")
    ranks = run_ddp(workers_ddp.planned, np=np_, scheme=scheme, density=DENSITY, dense=dense)
    rec0 = ranks[0]
    assert rec0["buckets"][-1] == rec0["groups"], (rec0["buckets"][-1], rec0["groups"])
    assert any(set(b) & set(dense) and set(b) - set(dense) for b in rec0["groups"])  # mixed
    expect = _reference(ranks, scheme, DENSITY)
    for step, want in enumerate(expect):
        for r, rec in enumerate(ranks):
            for n, g in rec["synced"][step].items():
                assert torch.equal(g, rec0["synced"][step][n]), (step, r, n)
                torch.testing.assert_close(g, want[n], rtol=1e-6, atol=1e-7,
                                           msg=lambda m: f"step {step}, rank {r}, {n}: {m}")
        for n in dense:  # dense: every element of the average, nothing held back
            local = sum(rec["local"][step][n] for rec in ranks) / np_
            torch.testing.assert_close(rec0["synced"][step][n], local, rtol=1e-6, atol=1e-7)
    dense_bytes = 4 * sum(rec0["local"][0][n].numel() for n in dense)
    assert rec0["bytes"][-1] > dense_bytes
    assert rec0["bytes"][-1] < dense_bytes + 4 * sum(g.numel() for g in rec0["local"][0].values()) / 2


def test_a_plan_that_sends_every_tensor_dense():
    """SSFusion's planner falls back to all dense where sparsifying does not pay: the hook
    then allreduces every bucket (DDP's average, nothing selected, no residuals)."""
    dense = ("0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias")
    ranks = run_ddp(workers_ddp.planned, np=2, scheme="ssfusion", density=DENSITY, steps=2,
                    dense=dense)
    for step in range(2):
        for n in dense:
            want = (ranks[0]["local"][step][n] + ranks[1]["local"][step][n]) / 2
            for rec in ranks:
                torch.testing.assert_close(rec["synced"][step][n], want, rtol=1e-6, atol=1e-7)
    assert ranks[0]["bytes"][-1] == 4 * sum(g.numel() for g in ranks[0]["local"][0].values())


def test_a_plan_through_the_density_warm_up():
    """The plan's ks scaled to each warm-up stage, as the Horovod engine scales them."""
    ranks = run_ddp(workers_ddp.planned, np=2, scheme="ssfusion", density=DENSITY, steps=6,
                    warmup=4, dense=("2.bias",))
    for step, want in enumerate(_reference(ranks, "ssfusion", DENSITY, warmup=4)):
        for rec in ranks:
            for n, g in rec["synced"][step].items():
                torch.testing.assert_close(g, want[n], rtol=1e-6, atol=1e-7)


def test_ranks_that_disagree_raise_on_every_rank():
    """Different densities, a plan on one rank only, and plans that do not fit the job
    (another scheme, density, world size or model): ValueError on every rank, alike, and
    a collective after them completes."""
    ranks = run_ddp(workers_ddp.disagree, np=2)
    for rec in ranks:
        assert rec["sum"] == 2.0
        assert rec["errors"] == ranks[0]["errors"] and rec["bad"] == ranks[0]["bad"]
    assert all("different ['density']" in e for e in [ranks[0]["errors"][0]])
    assert "different ['plan']" in ranks[0]["errors"][1]
    bad = ranks[0]["bad"]
    assert all(e is not None for e in bad.values()), bad
    assert "scheme 'ssfusion'" in bad["scheme"] and "density 0.01" in bad["density"]
    assert "must be a Plan" in bad["not a plan"] and "world size" in bad["world"]
    assert "not the model's" in bad["model"]


def test_measure_cost_gives_every_rank_one_plan():
    """``measure_cost`` (torch.distributed's collectives, the encode, the decode, each
    tensor's backward) on 2 ranks with their own batches: rank 0's numbers on both, so
    one plan; a backward time for each of the model's tensors; no gradients left behind;
    the planned hook then runs, ranks identical."""
    import json

    ranks = run_ddp(workers_ddp.measured, np=2)
    assert ranks[1]["cost"] == ranks[0]["cost"] and ranks[1]["plan"] == ranks[0]["plan"]
    cost = json.loads(ranks[0]["cost"])
    assert cost["world_size"] == 2 and len(cost["backward_s"]) == 6
    assert all(b > 0 for b in cost["backward_s"]) and cost["allgather"][1] > 0
    assert cost["sparsify"]["topk"]["gpu"][1] > 0 and len(cost["allgather_curve"]) >= 4
    assert ranks[0]["grads_left"] == 0
    for step in range(2):
        for n, g in ranks[0]["synced"][step].items():
            assert torch.equal(g, ranks[1]["synced"][step][n])
            assert torch.isfinite(g).all()


def test_dense_is_ddp_s_average():
    ranks = run_ddp(workers_ddp.record, np=2, scheme="dense", density=DENSITY, steps=2)
    for step in range(2):
        for n, g in ranks[0]["synced"][step].items():
            want = (ranks[0]["local"][step][n] + ranks[1]["local"][step][n]) / 2
            torch.testing.assert_close(g, want)


def test_density_warm_up_stages():
    """DGC's warm-up over 4 steps: each stage's buffers replace the last's, the residuals
    carry over, and every step equals the reference at the density in force."""
    ranks = run_ddp(workers_ddp.record, np=2, scheme="ssfusion", density=DENSITY, steps=6,
                    warmup=4)
    for step, want in enumerate(_reference(ranks, "ssfusion", DENSITY, warmup=4)):
        for rec in ranks:
            for n, g in rec["synced"][step].items():
                torch.testing.assert_close(g, want[n], rtol=1e-6, atol=1e-7)


def test_gradients_as_bucket_views():
    """DDP's ``gradient_as_bucket_view=True`` (no second copy of the gradients): the same
    synchronized gradients as the reference."""
    ranks = run_ddp(workers_ddp.record, np=2, scheme="ssfusion", density=DENSITY, as_view=True)
    for step, want in enumerate(_reference(ranks, "ssfusion", DENSITY)):
        for rec in ranks:
            for n, g in rec["synced"][step].items():
                torch.testing.assert_close(g, want[n], rtol=1e-6, atol=1e-7)


def test_no_sync_accumulation_is_synchronized_once():
    ranks = run_ddp(workers_ddp.record, np=2, scheme="per_tensor", density=DENSITY, steps=3,
                    no_sync=True)
    expect = _reference(ranks, "per_tensor", DENSITY)  # ("local" holds both batches' sum)
    for step, want in enumerate(expect):
        for n, g in ranks[1]["synced"][step].items():
            torch.testing.assert_close(g, want[n], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("scheme,cap,dense", [("per_tensor", 0.004, None), ("ssfusion", 25, None),
                                              ("multi_tensor", 25, None),
                                              ("per_tensor", None, ("2.bias", "4.weight"))])
def test_resume_is_bit_identical(scheme, cap, dense):
    """per_tensor selects tensor by tensor, whatever DDP's buckets; the schemes that select
    over a bucket continue exactly where DDP's first buckets hold the tensors of the
    checkpoint's (here one bucket; ssfusion_hvd/ddp.py warns where they do not). Under a
    plan (its buckets, its dense tensors) too."""
    ranks = run_ddp(workers_ddp.resume, np=2, scheme=scheme, density=DENSITY, bucket_cap_mb=cap,
                    dense=dense)
    for rec in ranks:
        assert len(rec["through"]) == len(rec["resumed"]) == 5
        for a, b in zip(rec["through"], rec["resumed"]):
            for n in a:
                assert torch.equal(a[n], b[n]), n


@pytest.mark.parametrize("scheme,cap", [("ssfusion", 25), ("per_tensor", 0.004)])
def test_adam_resume_is_bit_identical_with_the_senders_spreads(scheme, cap):
    """Under Adam the hook's entries carry their senders' spreads; each element's wait and
    sum of squares go into the checkpoint with the residuals, so a resumed job steps
    exactly as the uninterrupted one (ssfusion in one bucket, as in the gradients' resume
    test: DDP's first buckets after a load differ from its rebuilt ones)."""
    ranks = run_ddp(workers_ddp.resume_adam, np=2, scheme=scheme, density=DENSITY,
                    bucket_cap_mb=cap)
    for rec in ranks:
        assert rec["spread"] and rec["noise"] > 0
        assert any(v > 0 for v in rec["squares"].values()) and max(rec["waits"].values()) > 1
        assert len(rec["through"]) == len(rec["resumed"]) == 6
        for a, b in zip(rec["through"], rec["resumed"]):
            for n in a:
                assert torch.equal(a[n], b[n]), n
    for n, w in ranks[0]["through"][-1].items():
        assert torch.equal(w, ranks[1]["through"][-1][n])


def test_bad_input_raises_on_every_rank_before_any_collective():
    ranks = run_ddp(workers_ddp.bad_input, np=2)
    for rec in ranks:
        assert rec["sum"] == 2.0
        assert all(e is not None for e in rec["errors"].values()), rec["errors"]
        assert rec["errors"] == ranks[0]["errors"]
    assert "unknown scheme 'nope'" in ranks[0]["errors"]["{'scheme': 'nope'}"]
    assert "DistributedDataParallel" in ranks[0]["errors"]["not ddp"]


@pytest.mark.parametrize("kind,dense", [("sgd", None), ("adam", None), ("adamw", None),
                                        ("sgd", ("0.bias", "2.weight")), ("adam", ("4.bias",))])
def test_the_recipe_at_density_1_is_the_optimizer_on_the_average(kind, dense):
    """With the optimizer given, the hook's recipe (shared moments, coupled weight decay
    folded before the error feedback, the wrapped step) is exactly SGD (Nesterov, weight
    decay) / Adam / AdamW on the averaged gradient when every element is sent; with a plan
    too, whose dense tensors the optimizer's own step moves."""
    ranks = run_ddp(workers_ddp.dense_limit, np=2, kind=kind, dense=dense)
    for rec in ranks:
        for n, want in rec["ddp"].items():
            torch.testing.assert_close(rec["hook"][n], want, rtol=1e-5, atol=1e-6)
            assert not torch.equal(want, workers_ddp._model().state_dict()[n])  # it trained
    for n in ranks[0]["hook"]:
        assert torch.equal(ranks[0]["hook"][n], ranks[1]["hook"][n])


def test_torchrun_launches_it():
    """Launched as users launch DDP: torchrun, the process group from its environment."""
    from ddprun import run_torchrun

    ranks = run_torchrun(workers_ddp.__file__, 2, [])
    expect = _reference(ranks, "ssfusion", DENSITY)
    for step, want in enumerate(expect):
        for rec in ranks:
            for n, g in rec["synced"][step].items():
                torch.testing.assert_close(g, want[n], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dense", [None, ("0.bias", "2.weight")])
def test_a_step_gradscaler_skips_is_undone_on_every_rank(dense):
    """Rank 1's loss is infinite at step 2: every rank's bucket comes back NaN (the flag
    each record carries), GradScaler skips the step on both, and the hook undoes what the
    step did to the residuals. The job then equals one that never had step 2, bit for bit,
    although the two scalers' scales differ from then on (the state is kept unscaled).
    Under a plan with dense tensors in the buckets too."""
    skipped = run_ddp(workers_ddp.scaler_steps, np=2, steps=[0, 1, 2, 3, 4], poison=2, dense=dense)
    never = run_ddp(workers_ddp.scaler_steps, np=2, steps=[0, 1, 3, 4], dense=dense)
    assert skipped[0]["scales"][2] == skipped[0]["scales"][1] / 2  # it backed off: skipped
    assert skipped[0]["scales"][-1] != never[0]["scales"][-1]
    for a, b in zip(skipped, never):
        for n in a["params"]:
            assert torch.equal(a["params"][n], b["params"][n]), n
        assert a["residuals"].keys() == b["residuals"].keys()
        for n in a["residuals"]:
            assert torch.isfinite(a["residuals"][n]).all()
            assert torch.equal(a["residuals"][n], b["residuals"][n]), n


_CUDA = torch.cuda.is_available()


@pytest.mark.skipif(not _CUDA, reason="needs a GPU")
@pytest.mark.parametrize("backend,np_", [("nccl", 1), ("gloo", 2)])
@pytest.mark.parametrize("scheme", ["per_tensor", "multi_tensor", "ssfusion"])
def test_gpu_synchronized_gradients_equal_the_reference(scheme, backend, np_):
    """On CUDA tensors: NCCL with one rank (NCCL does not let two ranks share a GPU), and
    gloo with two ranks sharing the GPU (its allgather stages CUDA tensors through the
    host). The same reference as on the CPU, from the gradients each rank computed there."""
    if backend == "nccl" and not torch.distributed.is_nccl_available():
        pytest.skip("torch built without NCCL")
    ranks = run_ddp(workers_ddp.record, np=np_, backend=backend, scheme=scheme,
                    density=DENSITY, device="cuda")
    assert len(ranks[0]["buckets"][-1]) > 1
    for step, want in enumerate(_reference(ranks, scheme, DENSITY)):
        for r, rec in enumerate(ranks):
            for n, g in rec["synced"][step].items():
                assert torch.equal(g, ranks[0]["synced"][step][n]), (step, r, n)
                torch.testing.assert_close(g, want[n], rtol=1e-6, atol=1e-7)


def test_make_plan_checks_its_input_and_ddp_kwargs_cover_the_model():
    """No process group needed: make_plan is a function of the model and the cost model."""
    import ssfusion_hvd.ddp as sd
    from ssfusion_hvd.plan import CostModel, default_backward_times

    model = workers_ddp._model()
    sizes = [p.numel() for p in model.parameters()][::-1]
    fit = {"topk": {"cpu": (2e-5, 3e-10), "gpu": (2e-5, 3e-10)}}
    cost = CostModel.from_network(1e7, 50e-6, 2, default_backward_times(sizes), sparsify=fit)
    for bad, what in (({"cost": "nope.json"}, "No such file"), ({"cost": 3}, "CostModel"),
                      ({"scheme": "x"}, "unknown scheme"), ({"density": 0}, "density"),
                      ({"sparsifier": "dgc"}, "no selection time for 'dgc'")):
        kw = {"cost": cost, **bad}
        with pytest.raises((ValueError, FileNotFoundError), match=what):
            sd.make_plan(model, **kw)
    plan = sd.make_plan(model, cost, "per_tensor", 0.1)
    assert plan.names == [n for n, _ in model.named_parameters()][::-1] and "backward" not in plan.notes
    caps = sd.ddp_kwargs(plan)["bucket_cap_mb_list"]
    assert len(caps) == len(plan.groups) and sum(caps) * 2 ** 20 == 4 * sum(sizes)
    other = CostModel.from_network(1e7, 50e-6, 2, default_backward_times([10, 10]), sparsify=fit)
    assert "for 2 tensors" in sd.make_plan(model, other, "per_tensor", 0.1).notes["backward"]
    with pytest.raises(ValueError, match="must be a Plan"):
        sd.ddp_kwargs("plan.json")



@pytest.mark.parametrize("select_by", ["auto", "step", "magnitude"])
def test_adam_buckets_select_the_largest_pending_gains(select_by):
    """With Adam given as ``optimizer``, each bucket's budget (one element per tensor, the
    rest shared) goes by default to the elements whose pending sum times its step is
    largest, ranked as |acc| / sqrt(sqrt(v-hat) + eps) from the optimizer's state, as the
    Horovod planned schemes select (tests/test_moments.py); ``select_by="step"`` to those
    whose step |acc| / (sqrt(v-hat) + eps) is, ``"magnitude"`` to the largest |acc|. Each
    rank's sent set (where its residual was zeroed) equals the reference on every step
    after Adam's first, and the keys differ from the magnitude's on them."""
    from ssfusion_hvd.plan.cost import nominal_k
    from test_schemes import group_select

    ranks = run_ddp(workers_ddp.adam_selection, np=2, select_by=select_by)
    group = ranks[0]["group"]
    b2, eps, wd = group["betas"][1], group["eps"], group["weight_decay"]
    checked = differ = 0
    for rec in ranks:
        for st in rec["steps"]:
            stateful = all("exp_avg_sq" in st["state"][n] for n in st["params"])
            for bucket in st["buckets"]:
                accs, keys = [], []
                for n in bucket:
                    acc = (st["residuals"].get(n, torch.zeros_like(st["local"][n]))
                           + st["local"][n] + wd * st["params"][n]).reshape(-1)
                    accs.append(acc)
                    if stateful and select_by != "magnitude":
                        s = st["state"][n]
                        # the rule's denominator, the square root correctly rounded (numpy's)
                        b2s = math.sqrt(1.0 - b2 ** float(s["step"]))
                        denom = torch.from_numpy(np.sqrt(s["exp_avg_sq"].reshape(-1).numpy())) / b2s + eps
                        if select_by == "auto":  # the gain's: its square root
                            denom = torch.from_numpy(np.sqrt(denom.numpy()))
                        keys.append((acc / denom).abs())
                    else:
                        keys.append(acc.abs())
                sizes = [a.numel() for a in accs]
                k = sum(int(nominal_k(n, 0.1)) for n in sizes)
                acc = torch.cat(accs)
                want = set(group_select(torch.cat(keys), sizes, k, [1] * len(sizes))[1].tolist())
                differ += want != set(group_select(acc, sizes, k, [1] * len(sizes))[1].tolist())
                sent = torch.cat([st["after"][n].reshape(-1) for n in bucket]) == 0
                got = set((sent & (acc != 0)).nonzero().flatten().tolist())
                assert got == {j for j in want if acc[j] != 0}, (select_by, bucket)
                checked += stateful
    assert checked >= 8
    assert (differ > 0) == (select_by != "magnitude"), differ


def test_the_hook_imports_without_horovod():
    """``ssfusion_hvd.ddp`` is the face for jobs without Horovod: importing it (and its
    ``select_by`` choices) loads no Horovod module."""
    import subprocess
    import sys
    code = ("import sys\n"
            "import ssfusion_hvd.ddp\n"
            "assert not [k for k in sys.modules if k.startswith('horovod')], "
            "sorted(k for k in sys.modules if k.startswith('horovod'))\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
