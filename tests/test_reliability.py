"""Failure modes across ranks: a model that differs between ranks, a worker that dies.

Mismatched models must raise ValueError on every rank (never a hang or a shape error deep
inside a collective); a SIGKILLed worker must bring the whole job down quickly with a
message that says what happened, for every scheme.
"""
import re
import sys
import time

import pytest
import torch
import torch.nn as nn

from hvdrun import TESTS, launch, run_workers
import workers_reliability
import workers_schemes
from ssfusion_hvd.consistency import mismatch_message, model_signature

WORKER = str(TESTS / "workers_reliability.py")
KILL_STEP = 5
DEADLINE_S = 60.0  # after the kill, the whole horovodrun must be over within this
SHUTDOWN = "Horovod has been shut down"

EXPECTED = {  # case -> what the message must say besides naming rank 1 as the culprit
    "names": "rank 1 has parameter 'extra.bias' that rank 0 lacks",
    "shape": "rank 1: parameter 'fc.weight' has shape (10, 4), rank 0 has (10, 3)",
    "order": "parameters are declared in a different order on rank 1: optimizer parameter #0 "
             "is 'out.bias' on rank 1, 'fc.weight' on rank 0",
}


def _check_messages(results):
    for r in results:
        assert r["total"] == 2.0  # ranks still in step after the error
        assert r["messages"]["same"] is None
        for case, needle in EXPECTED.items():
            msg = r["messages"][case]
            assert msg is not None, f"{case}: no ValueError"
            assert needle in msg, (case, msg)
            assert "rank 1 differs from rank 0" in msg, (case, msg)
            assert "All ranks must build the same model" in msg, (case, msg)
    assert results[0]["messages"] == results[1]["messages"]  # same words on every rank


# --------------------------------------------------------------------------- pure parts
def test_signature_lists_parameters_then_declared_order():
    model = nn.Sequential(nn.Linear(3, 2))
    named = sorted(model.named_parameters())
    sig = model_signature(named, ["0.weight", "0.bias"])
    assert sig == [("0.bias", (2,), "torch.float32", True),
                   ("0.weight", (2, 3), "torch.float32", True), ("0.weight", "0.bias")]
    assert mismatch_message([sig, list(sig), list(sig)]) is None


def test_mismatch_message_names_every_differing_rank():
    base = [("a", (2,), "torch.float32", True), ("b", (3, 3), "torch.float32", True), ("a", "b")]
    dtype = [base[0], ("b", (3, 3), "torch.float16", True), ("a", "b")]
    frozen = [("a", (2,), "torch.float32", False), base[1], ("a", "b")]
    lacks = [base[0], ("a",)]
    msg = mismatch_message([base, base, dtype, frozen, lacks], ranks=[0, 1, 2, 3, 5])
    assert "ranks 2, 3, 5 differ from rank 0" in msg
    assert "rank 1" not in msg
    assert "rank 2: parameter 'b' has dtype torch.float16, rank 0 has torch.float32" in msg
    assert "rank 3: parameter 'a' has requires_grad=False, rank 0 has requires_grad=True" in msg
    assert "rank 5 lacks parameter 'b' that rank 0 has" in msg


# --------------------------------------------------------------------------- on workers
@pytest.mark.multiworker
def test_mismatched_models_raise_on_every_rank():
    _check_messages(run_workers(workers_reliability.check_cases, np=2, timeout=120))


@pytest.mark.multiworker
def test_single_rank_check_is_a_no_op():
    [r] = run_workers(workers_reliability.check_cases, np=1, timeout=120)
    assert r["total"] == 1.0
    assert all(m is None for m in r["messages"].values())


@pytest.mark.multiworker
def test_distributed_optimizer_rejects_mismatched_models():
    _check_messages(run_workers(workers_reliability.optimizer_cases, np=2, timeout=120,
                                scheme="dense"))


def _run_kill(scheme, wrap_killed):
    """Trains on 3 workers, rank 1 SIGKILLs itself at KILL_STEP; returns (rc, output, seconds
    from the kill to the end of horovodrun). With ``wrap_killed`` rank 1's slot stays alive
    (a shell sleeps in place of the dead process), so horovodrun cannot notice the death
    itself and only the surviving ranks can end the job."""
    train = [sys.executable, WORKER, "train", scheme, "1", str(KILL_STEP)]
    if wrap_killed:
        script = ('"$@"; rc=$?; if [ "$rc" = 137 ]; then echo "slot of the killed rank '
                  'stays alive"; exec sleep 300; fi; exit "$rc"')
        train = ["sh", "-c", script, "sh"] + train
    rc, out = launch(train, np=3, timeout=120)
    end = time.time()
    killed = re.search(r"KILLING rank 1 at step 5 t=([0-9.]+)", out)
    assert killed, out[-6000:]
    return rc, out, end - float(killed.group(1))


@pytest.mark.multiworker
@pytest.mark.parametrize("scheme", ["dense"])
def test_killed_worker_ends_the_job(scheme):
    rc, out, after_kill = _run_kill(scheme, wrap_killed=False)
    assert rc != 0, out[-6000:]
    assert after_kill < DEADLINE_S, (after_kill, out[-6000:])
    assert re.search(r"Process 1 exit with status code (137|-9)\.", out), out[-6000:]
    assert "Horovod detected that one or more processes exited with non-zero status" in out
    assert "finished 1000 steps" not in out


@pytest.mark.multiworker
@pytest.mark.parametrize("scheme", ["dense", "ssfusion_oi"])
def test_survivors_of_a_killed_worker_fail_on_their_own(scheme):
    rc, out, after_kill = _run_kill(scheme, wrap_killed=True)
    assert "slot of the killed rank stays alive" in out, out[-6000:]
    assert rc != 0, out[-6000:]
    assert after_kill < DEADLINE_S, (after_kill, out[-6000:])
    assert "most recent call first" not in out, out[-6000:]  # no faulthandler dump: no hang
    # a survivor (not the launcher) ended the job, with Horovod's own error
    assert re.search(r"Process [02] exit with status code 1\.", out), out[-6000:]
    assert re.search(r"\[[02]\]<stderr>:horovod\.common\.exceptions\.HorovodInternalError: "
                     + SHUTDOWN, out), out[-6000:]
    assert "finished 1000 steps" not in out


@pytest.mark.multiworker
@pytest.mark.parametrize("scheme,sparsifier", [("ssfusion_oi", "topk"), ("per_tensor", "threshold"),
                                               ("multi_tensor", "randomk")])
def test_checkpoint_restart_is_bit_identical(scheme, sparsifier, tmp_path):
    """Save at step 4 (after the 2 warm-up steps: the plan, residuals and sparsifier state
    are in the checkpoint), restart in a new job, 4 more steps: bit-identical parameters."""
    kw = dict(scheme=scheme, sparsifier=sparsifier, ckpt_dir=str(tmp_path))
    straight = run_workers(workers_schemes.checkpoint_run, np=2, timeout=240, **kw)
    resumed = run_workers(workers_schemes.checkpoint_resume, np=2, timeout=240, **kw)
    for r in range(2):
        for n, t in straight[r].items():
            assert torch.equal(resumed[r][n], t), (r, n)


@pytest.mark.multiworker
def test_nonfinite_gradients_reach_every_rank_and_the_step_is_undone():
    """Rank 1 poisons two elements (NaN, Inf) of two tensors at step 3. Dense: they reach
    every rank's synchronized gradient (Horovod's sum). Sparse schemes: even where the
    selection would hold one back (``c.bias`` sends k=1 per step, and NaN ranks above
    Inf), every rank learns of them in that step, undoes it (``stats()["skipped"]``) and
    finds its whole synchronized gradient NaN; nothing stays in a residual, so step 4 is
    finite again."""
    for scheme in ("dense", "per_tensor", "multi_tensor", "forced", "spardl", "zen"):
        runs = run_workers(workers_schemes.nonfinite, np=2, timeout=240, scheme=scheme)
        for run in runs:
            for name in ("a.weight", "c.bias"):
                g = run[3]["grads"][name].reshape(-1)
                assert not torch.isfinite(g[0]) and not torch.isfinite(g[1]), (scheme, name)
            assert all(s["stats"].get("nonfinite", 0) == 0 for s in run[:3]), scheme
            if scheme != "dense":
                assert all(not torch.isfinite(g).any() for g in run[3]["grads"].values())
                assert [s["stats"]["skipped"] for s in run] == [False] * 3 + [True, False]
                assert all(torch.isfinite(g).all() for g in run[4]["grads"].values()), scheme


@pytest.mark.multiworker
def test_scheme_options_are_validated_and_agreed_on_every_rank():
    out = run_workers(workers_reliability.options_cases, np=2, timeout=180)
    for r in out:  # every rank raised the same errors and is still in step
        assert r["total"] == 2.0
        m = r["messages"]
        assert m == out[0]["messages"]
        assert "scheme 'exdyna' has no option 'blocks'" in m["unknown"]
        assert "blocks_per_worker" in m["unknown"]  # the message lists what exists
        assert "option 'alpha' must be a number > 1, got 0.5" in m["bad_value"]
        assert "scheme_options must be a dict" in m["not_a_dict"]
        assert "scheme 'dense' has no option 'teams'; its options: none" in m["dense_has_none"]
        assert "setup differs across ranks: rank 1 run" in m["differs"]
        assert "('blocks_per_worker', 32)" in m["differs"]
        assert "setup differs across ranks" in m["scheme_differs"]
        assert m["same"] is None
        # the SSFusion schemes' small-tensor rule (min_k): checked, agreed, not the baselines'
        assert "option 'min_k' must be an int >= 0" in m["min_k_bad"]
        assert "scheme 'per_tensor' has no option 'min_k'" in m["min_k_baseline"]
        assert "('min_k', 32)" in m["min_k_differs"] and "setup differs" in m["min_k_differs"]
        assert m["min_k_same"] is None
        assert "option 'waits' must be 'auto', True or False, got 1" in m["waits_bad"]
        assert "scheme 'zen' has no option 'waits'" in m["waits_zen"]
        assert "('waits', True)" in m["waits_differs"] and "setup differs" in m["waits_differs"]
        assert m["waits_same"] is None


@pytest.mark.multiworker
def test_a_dropped_optimizer_and_its_offload_thread_are_released():
    for r in run_workers(workers_reliability.released, np=2, timeout=180):
        assert r["workers_during"] == 1
        assert not r["optimizer_alive"]
        assert r["workers_after"] == 0


@pytest.mark.multiworker
def test_a_rank_that_waits_sleeps_instead_of_spinning():
    """Horovod's synchronize() spins on sched_yield, taking a shared core from the rank
    everybody waits for; Transport.wait sleeps between polls. Rank 0 waits ~1 s for rank 1
    both ways: ours must return the right output after using a small share of a core, and
    several times less CPU than Horovod's own wait measured the same way (the spinning this
    guards against; compared with each other rather than with a whole core, so that a
    loaded machine, which gives the spin less than a core, still tells them apart)."""
    rank0 = run_workers(workers_reliability.waiting, np=2, timeout=120, delay=1.0)[0]
    (wall, cpu, ok), (h_wall, h_cpu, h_ok) = rank0["ours"], rank0["horovod"]
    assert ok and h_ok
    assert wall > 0.5 and h_wall > 0.5, rank0  # rank 0 did wait for rank 1
    assert cpu < 0.25 * wall, rank0
    assert h_cpu > 4 * cpu, rank0
    # a handle waited a second time gives None, as Horovod's synchronize does
    assert rank0["ours_again"] is None and rank0["horovod_again"] is None
    assert rank0["bf16"] == [2.0] * 4 and rank0["bf16_again"] is None


@pytest.mark.parametrize("local_ranks, cores, spins", [(2, 2, False), (4, 2, False),
                                                       (2, 4, True), (4, 16, True),
                                                       (8, 8, False)])
def test_waits_spin_only_where_every_local_rank_has_its_cores(monkeypatch, local_ranks, cores,
                                                              spins):
    """Sleeping between polls adds up to POLL_MAX_S to a wait, which a GPU step on a host
    with cores to spare should not pay; spinning takes a core from the rank everyone waits
    for where ranks share cores. Transport decides once, by the local ranks and the usable
    cores (two per rank: its own thread and Horovod's background thread)."""
    import os

    import ssfusion_hvd.core.transport as transport

    monkeypatch.setattr(transport._mpi, "local_size", lambda: local_ranks)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(transport, "_SPIN", None)
    assert transport._spin() is spins
