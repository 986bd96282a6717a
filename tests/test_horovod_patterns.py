"""Horovod's everyday patterns with every scheme, on real Horovod workers: resume from a
rank-0 checkpoint with ``hvd.broadcast_optimizer_state``, the fresh-start broadcast for
every torch optimizer, process sets. A hang fails the test (the workers are killed at
the timeout)."""
import pytest
import torch

from hvdrun import run_workers
import workers_horovod
from ssfusion_hvd.plan import Plan

pytestmark = pytest.mark.multiworker

SCHEMES = ["dense", "per_tensor", "multi_tensor", "ssfusion_oi", "zen", "exdyna", "spardl"]


def _equal_dicts(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if torch.is_tensor(a[k]):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Every scheme x (SGD, Adam) x (rank 0 loads / every rank loads its own state)."""
    out = {}
    ckpt = tmp_path_factory.mktemp("ckpt")
    for scheme in SCHEMES:  # one job per scheme
        ranks = run_workers(workers_horovod.resume_cases, np=2, timeout=400, scheme=scheme,
                            optimizers=["sgd", "adam"], owns=[False, True], ckpt_dir=str(ckpt))
        for key in ranks[0]:
            out[(scheme,) + key] = [r[key] for r in ranks]
    return out


@pytest.mark.parametrize("own", [False, True], ids=["rank0_loads", "every_rank_loads"])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_resume_the_horovod_way(resumed, scheme, opt, own):
    """Rank 0 loads the checkpoint (or every rank its own), then broadcast_parameters and
    broadcast_optimizer_state: no hang; every rank bit-identical in parameters, the
    optimizer's state and hyper-parameters (rank 0's, although they differed per rank
    before the broadcast) and plan; rank 0's plan and step are adopted."""
    r0, r1 = resumed[scheme, opt, own]
    _equal_dicts(r0["resumed"], r1["resumed"])
    _equal_dicts(r0["after_broadcast"][0], r1["after_broadcast"][0])
    assert r0["after_broadcast"][1] == r1["after_broadcast"][1]
    assert r0["recipe"] == r1["recipe"]
    assert r0["plan"] == r1["plan"] == r0["straight_plan"]
    if r0["plan"] is not None:  # the scheme under test: something sparsified
        assert any(Plan.from_json(r0["plan"]).sparse)
    if scheme != "dense":  # the local rule follows rank 0's (broadcast) hyper-parameters
        want = {"momentum": 0.9} if opt == "sgd" else {"betas": (0.9, 0.999)}
        assert {k: r1["recipe"][1][k] for k in want} == want
    if own or scheme == "dense":
        # every rank restored its own residuals and local state (or there is none): the
        # resumed run is the uninterrupted one, bit for bit
        _equal_dicts(r0["resumed"], r0["straight"])
    else:
        # rank 1 had no checkpoint: its residuals started from zero, not from rank 0's
        # (which continue on rank 0); the run differs from the uninterrupted one
        assert any(not torch.equal(r0["resumed"][n], r0["straight"][n]) for n in r0["resumed"])
        saved0 = r0["saved_own"]["residuals"]
        assert saved0 and all(not torch.equal(r1["own_after_adopt"]["residuals"][n], saved0[n])
                              for n in saved0 if saved0[n].any())


@pytest.mark.parametrize("scheme", ["ssfusion_oi", "zen", "ssfusion_oi+waits"])
def test_resume_with_shared_moments(scheme, tmp_path):
    """``moments="shared"``: the optimizer state is the same on every rank and lives in
    torch's entries, the ages in ours. Every rank loading its own checkpoint resumes the
    uninterrupted run bit for bit (ages included, and with ``waits`` each rank's waits,
    saved with its residuals); a rank-0 load followed by the broadcast leaves every rank
    bit-identical, with the ages restarted on all of them alike."""
    scheme, _, waits = scheme.partition("+")
    ranks = run_workers(workers_horovod.resume_cases, np=2, timeout=400, scheme=scheme,
                        optimizers=["sgd", "adam"], owns=[False, True], ckpt_dir=str(tmp_path),
                        moments="shared", options={"waits": True} if waits else None)
    for kind in ("sgd", "adam"):
        for own in (False, True):
            a, b = ranks[0][kind, own], ranks[1][kind, own]
            _equal_dicts(a["resumed"], b["resumed"])
            _equal_dicts(a["after_broadcast"][0], b["after_broadcast"][0])
            # (SGD with waits: the senders' waits, per rank, replace the shared ages)
            assert bool(a["ages"]) != (kind == "sgd" and bool(waits))
            assert a["ages"].keys() == b["ages"].keys()
            _equal_dicts(a["ages"], b["ages"])
            if own:
                _equal_dicts(a["resumed"], a["straight"])
            else:  # rank 1's residuals restarted from zero: another run than the straight one
                assert any(not torch.equal(a["resumed"][n], a["straight"][n]) for n in a["resumed"])


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_checkpoint_of_ours_loads_anywhere(optimizer, tmp_path):
    """``state_dict()`` keeps the sparsified tensors' optimizer state where torch keeps it
    (SGD's momentum buffer, Adam's moments and step), so a checkpoint of ZEN (which owns
    every tensor's state) continues under a plain torch optimizer, Horovod's optimizer,
    and ours with another scheme (dense, SparDL) exactly where the uninterrupted run goes
    (density 1, the same batches on every rank: the rules are then the torch optimizer)."""
    ranks = run_workers(workers_horovod.portable, np=2, timeout=300, optimizer=optimizer,
                        ckpt_dir=str(tmp_path))
    for r in ranks:
        for name in ("torch", "horovod", "dense", "spardl"):
            for n, t in r["straight"].items():
                torch.testing.assert_close(r[name][n], t, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{name}, {n}: {m}")
    state = ranks[0]["torch_state"]  # the real state, not zero placeholders
    buffers = ("momentum_buffer",) if optimizer == "sgd" else ("exp_avg", "exp_avg_sq")
    assert state and all(st[b].abs().sum() > 0 for st in state.values() for b in buffers)
    if optimizer == "adam":
        assert all(float(st["step"]) == 4 for st in state.values())


def test_resume_rank0_equals_explicit_fresh_local_state(tmp_path):
    """Rank 1 without a checkpoint after the broadcast behaves exactly like rank 1
    loading rank 0's checkpoint with every per-rank store removed (residuals, velocity):
    "start from zero" is what happens, for ssfusion_oi with SGD's local rule (the per-rank
    velocity; shared moments have none: test_resume_with_shared_moments)."""
    a = run_workers(workers_horovod.resume, np=2, timeout=240, scheme="ssfusion_oi",
                    optimizer="sgd", own=False, ckpt_dir=str(tmp_path), moments="local")
    b = run_workers(workers_horovod.resume, np=2, timeout=240, scheme="ssfusion_oi",
                    optimizer="sgd", own=False, ckpt_dir=str(tmp_path), strip_rank1=True,
                    moments="local")
    for r in range(2):
        _equal_dicts(a[r]["resumed"], b[r]["resumed"])


OPTIMIZERS = ["sgd", "adam", "adamw", "Adadelta", "Adagrad", "Adamax", "ASGD", "NAdam",
              "RAdam", "RMSprop", "Rprop"]


@pytest.mark.parametrize("scheme", ["dense", "ssfusion_oi"])
def test_rank0_resume_for_every_optimizer(scheme, tmp_path):
    """The rank-0 resume pattern with every torch optimizer Horovod's tests use (per-rank
    hyper-parameters before the broadcast): no hang, every rank bit-identical in
    parameters, optimizer state and hyper-parameters."""
    ranks = run_workers(workers_horovod.resume_cases, np=2, timeout=400,
                        scheme=scheme, optimizers=OPTIMIZERS, ckpt_dir=str(tmp_path))
    for kind in OPTIMIZERS:
        a, b = ranks[0][kind, False], ranks[1][kind, False]
        _equal_dicts(a["resumed"], b["resumed"])
        _equal_dicts(a["after_broadcast"][0], b["after_broadcast"][0])
        assert a["after_broadcast"][1] == b["after_broadcast"][1], kind
        assert a["plan"] == b["plan"] == a["straight_plan"], kind


@pytest.mark.parametrize("scheme", ["dense", "ssfusion_oi", "zen"])
def test_fresh_broadcast_for_every_optimizer(scheme):
    """The fresh-start pattern (per-rank initial weights and hyper-parameters, then
    broadcast_parameters + broadcast_optimizer_state) for every torch optimizer Horovod's
    tests use: no hang, identical state and hyper-parameters after the broadcast, and
    identical parameters and state after training."""
    ranks = run_workers(workers_horovod.fresh_broadcast, np=2, timeout=400, scheme=scheme,
                        optimizers=OPTIMIZERS)
    for kind in OPTIMIZERS:
        a, b = ranks[0][kind], ranks[1][kind]
        _equal_dicts(a["state"], b["state"])
        assert a["groups"] == b["groups"], kind
        _equal_dicts(a["params"], b["params"])
        _equal_dicts(a["final_state"], b["final_state"])


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("np_,layout", [(2, [[0], [1]]), (3, [[0, 1], [2]])],
                         ids=["two_singles", "pair_and_single"])
def test_process_sets(scheme, np_, layout):
    """Disjoint process sets used at once: each optimizer synchronizes within its set
    (the pair's ranks end identical, planned in the sparse schemes) and no rank waits on
    a rank outside its set."""
    ranks = run_workers(workers_horovod.process_sets, np=np_, timeout=180,
                        env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}, rerun_on_gloo_timeout=True,
                        scheme=scheme, layout=layout)
    for ranks_of_set in layout:
        first = ranks[ranks_of_set[0]]
        for r in ranks_of_set[1:]:
            _equal_dicts(first["params"], ranks[r]["params"])
            assert first["plan"] == ranks[r]["plan"]
        if scheme != "dense":
            assert first["stats"]["phase"] in ("planned", "sparse"), first["stats"]
    if np_ == 3:  # the pair averaged its gradients, the single rank did not
        assert any(not torch.equal(ranks[0]["params"][n], ranks[2]["params"][n])
                   for n in ranks[0]["params"])


WRAPPED = [(0, False, False), (3, False, False), (10, False, False), (3, True, False),
           (10, False, True)]  # (wrappers around step, torch.compile, our explicit broadcast)


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory):
    """One job per scheme, every case of WRAPPED in it."""
    out = {}
    for scheme in ("dense", "ssfusion_oi", "zen"):
        d = tmp_path_factory.mktemp(f"wrapped-{scheme}")
        out[scheme] = run_workers(workers_horovod.wrapped_resume, np=2, timeout=180,
                                  scheme=scheme, cases=WRAPPED, ckpt_dir=str(d))
    return out


@pytest.mark.parametrize("case", WRAPPED, ids=lambda c: f"{c[0]}wrappers{'-compiled' if c[1] else ''}"
                         f"{'-explicit' if c[2] else ''}")
@pytest.mark.parametrize("scheme", ["dense", "ssfusion_oi", "zen"])
def test_resume_with_wrapped_step(wrapped, scheme, case):
    """The rank-0 resume pattern with an LR scheduler and 0, 3 or 10 more wrappers around
    ``step`` (or ``torch.compile``): the broadcast's state-initializing step is recognized
    at any depth, so it runs no collective on the ranks that take it (nothing hung), moves
    no parameter, and the ranks continue identical. Dense training resumes exactly where
    the uninterrupted run went."""
    r0, r1 = wrapped[scheme][0][tuple(case)], wrapped[scheme][1][tuple(case)]
    _equal_dicts(r0["after_broadcast"], r1["after_broadcast"])
    _equal_dicts(r0["resumed"], r1["resumed"])
    if scheme == "dense":
        _equal_dicts(r0["resumed"], r0["straight"])
    assert all(torch.isfinite(t).all() for t in r0["resumed"].values())


@pytest.fixture(scope="module")
def outside():
    """One job per size: every scheme's optimizer built on every rank with the even
    ranks' process set (Horovod's own test shape)."""
    return {np_: run_workers(workers_horovod.outside_the_set, np=np_, timeout=240,
                             env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"},
                             rerun_on_gloo_timeout=True, schemes=SCHEMES)
            for np_ in (2, 3)}


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("np_", [2, 3])
def test_rank_outside_the_process_set(outside, np_, scheme):
    """A rank outside the optimizer's process set makes no collective (the job finished:
    nothing hung) and steps on its own gradients exactly as a plain torch optimizer; the
    ranks inside synchronize among themselves (3 workers: ranks 0 and 2 end identical,
    and unlike a plain optimizer on their own batches)."""
    ranks = outside[np_]
    odd = [r for r in range(np_) if r % 2]
    for r in odd:
        assert not ranks[r]["included"]
        mine = ranks[r][scheme]
        _equal_dicts(mine["params"], mine["plain"])
        assert mine["stats"] == {}  # nothing synchronized
        assert mine["state"]["ssfusion"]["state"] == {}
    inside = ranks[0][scheme]
    assert ranks[0]["included"] and (scheme == "dense" or inside["stats"]["phase"] in ("planned", "sparse"))
    if np_ == 3:
        _equal_dicts(inside["params"], ranks[2][scheme]["params"])
        assert any(not torch.equal(inside["params"][n], inside["plain"][n]) for n in inside["params"])


@pytest.fixture(scope="module")
def behaviours():
    return {scheme: run_workers(workers_horovod.behaviours, np=2, timeout=300, scheme=scheme)
            for scheme in ("dense", "ssfusion_oi", "per_tensor", "zen", "exdyna", "spardl")}


BEHAVIOURS = ["clip", "no_skip", "different_outputs", "gan", "unnamed", "fresh_groups",
              "sparse_embedding_sparse", "sparse_embedding_as_dense"]


@pytest.mark.parametrize("scheme", ["dense", "ssfusion_oi", "per_tensor", "zen", "exdyna", "spardl"])
def test_horovod_optimizer_behaviours(behaviours, scheme):
    """What Horovod's own DistributedOptimizer tests exercise, with our optimizer: every
    behaviour runs to the end on both ranks (no hang) with bit-identical parameters;
    synchronize() + clipping + skip_synchronize() warns nothing, step() after
    synchronize() warns as Horovod does; bad names raise ValueError on every rank; a
    weight decay changed by load_state_dict and hvd.broadcast_optimizer_state is the one
    applied."""
    r0, r1 = behaviours[scheme]
    for b in BEHAVIOURS:
        _equal_dicts(r0[b]["params"], r1[b]["params"])
    for r in (r0, r1):
        assert r["clip"]["warnings"] == []
        assert len(r["no_skip"]["warnings"]) == 7
        assert "must be unique" in r["names"]["duplicate"]
        assert "were not named" in r["names"]["missing"]
        # the weight decay rank 0 loaded and broadcast is the one applied: none
        assert r["fresh_groups"]["weight_decay"] == [0.0]
        assert r["fresh_groups"]["moved"] == 0.0, scheme


@pytest.mark.parametrize("scheme", ["ssfusion_oi", "zen"])
def test_checkpoint_on_one_rank_without_broadcast_fails_clearly(scheme, tmp_path):
    """The mistake the resume pattern avoids: rank 0 loads a checkpoint (planned, step 6)
    and the job trains on without hvd.broadcast_optimizer_state. The step's agreement
    check fails on every rank with the same message instead of a hang."""
    errors = run_workers(workers_horovod.load_on_rank0_only, np=2, timeout=120,
                         scheme=scheme, ckpt_dir=str(tmp_path))
    assert errors[0] is not None and errors[0] == errors[1]
    assert "different points" in errors[0] and "broadcast_optimizer_state" in errors[0]


@pytest.mark.parametrize("scheme", ["ssfusion", "ssfusion_oi"])
def test_ranks_that_scale_the_plan_differently_raise_on_every_rank(scheme):
    """The agreement compares the plan in force, the warm-up stage's, not only the plan
    the ranks started from: rank 1's stage sends one element more of one tensor, and
    both ranks raise the same error at the first sparse step instead of decoding
    records laid out for another k (or waiting on a collective of another size)."""
    errors = run_workers(workers_horovod.stage_plans_differ, np=2, timeout=120, scheme=scheme)
    assert errors[0] is not None and errors[0] == errors[1]
    # the first sparse step (2 dense profiling steps), in the warm-up, at the same iteration
    assert "different plans" in errors[0] and "iteration from 2 to 2" in errors[0], errors[0]


@pytest.mark.parametrize("scheme", ["dense", "ssfusion_oi", "per_tensor", "spardl", "zen",
                                    "exdyna"])
def test_the_agreement_rides_on_the_steps_one_small_allreduce(scheme):
    """A scheme's agreement costs no collective of its own: its step makes exactly one
    small allreduce of the optimizer's, with the agreement (signature and the ranks'
    non-finite flags in one) and without it (the flags alone), warm-up steps included;
    the whole-gradient schemes too, whose first collectives leave with their last
    gradient, before the agreement. The runs with and without end with the same
    parameters. Dense (stateless, nothing to agree on) makes
    none."""
    on, off = (run_workers(workers_horovod.own_collectives, np=2, timeout=120,
                           scheme=scheme, agreement=a) for a in (True, False))
    for r in on:
        assert r["counts"] == [0 if scheme == "dense" else 1] * 6, (scheme, r["counts"])
    for r in off:
        assert r["counts"] == [0 if scheme == "dense" else 1] * 6, (scheme, r["counts"])
    _equal_dicts(on[0]["params"], off[0]["params"])
    _equal_dicts(on[0]["params"], on[1]["params"])


class _Gated:
    """A ``StepAgreement`` with the agreement ``handle`` in flight whose ``read`` records
    that it ran."""

    def __new__(cls, handle):
        from ssfusion_hvd.agreement import StepAgreement

        class Recorded(StepAgreement):
            reads = 0

            def read(self, scheme=None):
                self.reads += 1
                self._handle = None
        agreement = Recorded(None, [], "test")
        agreement._handle = handle
        return agreement


@pytest.mark.parametrize("first", ["collective", "agreement", "none in flight"])
def test_the_gate_waits_for_the_collective_or_the_agreement(monkeypatch, first):
    """A wait of the scheme's goes ahead as soon as its collective has completed (it may be
    decoded while the agreement is still in flight), and otherwise only once the agreement
    has been read: a collective that may never complete is not waited on first."""
    from ssfusion_hvd.core import transport

    polls = {"data": 0, "agreement": 0}
    done_after = {"data": 3 if first == "collective" else 50,  # (50: a wrong gate ends too)
                  "agreement": 3 if first == "agreement" else 50}

    def done(handle):
        polls[handle] += 1
        return polls[handle] > done_after[handle]

    monkeypatch.setattr(transport, "done", done)
    monkeypatch.setattr(transport, "pause_between_polls", lambda pause: pause)
    agreement = _Gated(None if first == "none in flight" else "agreement")
    agreement.gate("data")
    if first == "none in flight":
        assert polls == {"data": 0, "agreement": 0} and agreement.reads == 0
    elif first == "collective":
        assert agreement.reads == 0 and agreement._handle == "agreement" and polls["data"] == 4
    else:
        assert agreement.reads == 1 and agreement._handle is None and polls["data"] == 4


def test_allgathers_and_alltoalls_are_named_for_one_step(monkeypatch):
    """A scheme's allgathers and alltoalls carry its step in their names, so Horovod never
    answers one from its response cache (where a rank inside hvd.join() would take part
    and crash); its allreduces keep one name, which Horovod caches (a joined rank adds
    zeros to them). Without a step counter the names are the plain ones."""
    from ssfusion_hvd.core import transport

    names = []
    for fn in ("allgather_async", "alltoall_async", "allreduce_async_"):
        monkeypatch.setattr(transport._mpi, fn,
                            lambda *a, name, **k: names.append(name) or len(names))
    step = [7]
    tr = transport.Transport.__new__(transport.Transport)
    tr.tag, tr.process_set, tr.op, tr.size = "s0", None, transport.Sum, 2
    tr.sent = {"allreduce": 0, "allgather": 0, "alltoall": 0}
    tr.step = lambda: step[0]
    x = torch.zeros(2)
    tr.allgather(x, "ag")
    tr.send(x, 1, "p2p")
    tr.allreduce(x, "ar")
    step[0] = 8
    tr.alltoall(x, torch.tensor([1, 1], dtype=torch.int32), "a2a")
    tr.step = None
    tr.allgather(x, "ag")
    assert names == ["s0.ag@7", "s0.p2p@7", "s0.ar", "s0.a2a@8", "s0.ag"]


@pytest.mark.parametrize("scheme", ["dense", "ssfusion_oi", "multi_tensor", "spardl", "zen",
                                    "exdyna"])
def test_uneven_steps_with_hvd_join(scheme):
    """Rank 0 has 12 batches, rank 1 has 9 and then calls hvd.join(). Dense runs the extra
    steps as Horovod's optimizer does (the joined rank adds zeros). A sparse scheme's
    step agreement sees the joined rank and raises on rank 0, naming hvd.join() and the
    fixes, before the parameters change (the step's selection put back into the
    residuals): both ranks still hold the same parameters, rank 0 its residuals and
    momentum, rank 0 joins too, and a later collective completes on both (no hang), the
    allgathers and alltoalls rank 0 launched beside the joined rank notwithstanding.
    Nine steps: past the density warm-up, so the records have the shapes of earlier
    steps; under names Horovod had cached, the joined rank crashed on them
    (``Transport``'s ``step``)."""
    r0, r1 = run_workers(workers_horovod.uneven_join, np=2, timeout=180, scheme=scheme,
                         steps=(12, 9))
    assert r1["error"] is None
    if scheme == "dense":
        assert r0["error"] is None
        assert any(not torch.equal(r0["params"][n], r1["params"][n]) for n in r0["params"])
    else:
        assert "hvd.join()" in r0["error"] and "scheme='dense'" in r0["error"]
        assert r0["own_kept"] is True
        _equal_dicts(r0["params"], r1["params"])
    assert r0["join_error"] is None and r1["join_error"] is None
    assert r0["after"] == r1["after"] == 2.0 and r0["last"] == r1["last"]


def test_process_sets_with_live_probes():
    """The start-up probes, the cost model's and the plan's broadcasts run on each
    scheme's own process set (no profile given): a pair and a single rank plan at once."""
    ranks = run_workers(workers_horovod.process_sets, np=3, timeout=240,
                        env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}, rerun_on_gloo_timeout=True,
                        scheme="ssfusion_oi", layout=[[0, 1], [2]], probe=True)
    _equal_dicts(ranks[0]["params"], ranks[1]["params"])
    assert ranks[0]["plan"] == ranks[1]["plan"] is not None and ranks[2]["plan"] is not None
    assert all(r["stats"]["phase"] == "planned" for r in ranks)


def test_broadcast_between_different_schemes_fails_on_every_rank():
    errors = run_workers(workers_horovod.scheme_mismatch, np=2, timeout=120)
    assert all(e is not None and "setup differs across ranks" in e
               # each scheme's options with their defaults, the optimizer's family, moments
               and ("('per_tensor', [('select_by', 'auto'), ('spread', 'auto'), "
                    "('waits', 'auto')], 'sgd', 'shared')") in e
               and ("('ssfusion_oi', [('floor', 0.0), ('min_k', 0), ('select_by', 'auto'), "
                    "('slack', 0.2), ('spread', 'auto'), ('waits', 'auto')], 'sgd', 'shared')") in e
               for e in errors), errors


# --------------------------------------------------------------------- another job size
OTHER_SIZE = ["dense", "ssfusion_oi", "zen", "spardl", "exdyna"]


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_checkpoint_of_another_job_size(tmp_path, kind):
    """A checkpoint of a 2-rank job resumed by a 3-rank job (rank 0 loads, then Horovod's
    broadcasts): the scheme's size-bound state (plan, ZEN's hashing, SparDL's teams,
    residuals) is left behind with a warning on rank 0, the optimizer state carries over,
    and the job trains on, every rank identical and finite."""
    run_workers(workers_horovod.other_size_save, np=2, timeout=240, schemes=OTHER_SIZE,
                ckpt_dir=str(tmp_path), kind=kind)
    ranks = run_workers(workers_horovod.other_size_load, np=3, timeout=240,
                        schemes=OTHER_SIZE, ckpt_dir=str(tmp_path), kind=kind)
    for scheme in OTHER_SIZE:
        r0 = ranks[0][scheme]
        if scheme != "dense":
            assert r0["warned"], f"{scheme}: no warning about the job size"
            assert all(not r[scheme]["warned"] for r in ranks[1:])
        for k, st in r0["loaded"].items():  # the optimizer state carried over
            for b, v in st.items():
                for r in ranks:
                    torch.testing.assert_close(r[scheme]["live"][k][b], v, rtol=0, atol=0)
        for n, p in r0["params"].items():
            assert torch.isfinite(p).all(), (scheme, n)
            for r in ranks[1:]:
                assert torch.equal(r[scheme]["params"][n], p), (scheme, n)
