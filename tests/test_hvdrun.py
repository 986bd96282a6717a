"""The test harness's one rerun (``hvdrun.run_workers(rerun_on_gloo_timeout=True)``) is
taken only for the failure it is meant for: every rank's Horovod background loop ending
in a Gloo transport timeout, as CI printed it on 2026-11-29."""
from hvdrun import gloo_loop_timeout_on_every_rank

_LINE = ("[{r}]<stderr>:[2026-11-29 23:38:45.399923: E /tmp/b/horovod-0.28.1/horovod/common/"
         "operations.cc:697] [{r}]: Horovod background loop uncaught exception: [/tmp/b/"
         "horovod-0.28.1/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:{line}] Timed "
         "out waiting 30000ms for {op} operation to complete")
CI = "\n".join([_LINE.format(r=1, line=81, op="recv"), _LINE.format(r=2, line=133, op="send"),
                "[2]<stderr>:terminate called after throwing an instance of 'gloo::IoException'",
                _LINE.format(r=0, line=81, op="recv"), "Process 0 exit with status code 134."])


def test_every_rank_timing_out_in_gloo_is_recognized():
    assert gloo_loop_timeout_on_every_rank(CI, 3)


def test_anything_less_is_not():
    # a rank missing from the timeouts (it may have been the one astray), more ranks in
    # the job than timed out, a stall that Horovod reported instead, or a Python error
    assert not gloo_loop_timeout_on_every_rank(
        "\n".join(l for l in CI.splitlines() if not l.startswith("[0]")), 3)
    assert not gloo_loop_timeout_on_every_rank(CI, 4)
    stall = ("[0]<stderr>:WARNING: One or more tensors were submitted to be reduced, gathered "
             "or broadcasted by subset of ranks and are waiting for remainder of ranks for "
             "more than 60 seconds.")
    assert not gloo_loop_timeout_on_every_rank(stall, 2)
    assert not gloo_loop_timeout_on_every_rank("[rank 1] Traceback ... RanksDisagree", 2)
