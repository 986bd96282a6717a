"""Worker functions for tests/test_profile.py (run on every Horovod rank)."""
import horovod.torch as hvd

from ssfusion_hvd import profile

# 16 MiB: the per-byte time stays well above the noise even on a loaded 2-core machine
SMALL_COLLECTIVES = (4096, 1 << 20, 16 << 20)
SMALL_SPARSIFY = (8_000, 80_000)
SMALL_DECODE = (8_000, 80_000)


def measure(sparsifier="topk", subset=None):
    """measure_cost_model with small probes; returns the model's JSON and this rank's probes.

    ``subset``: global ranks of a process set to measure on (the others only check in).
    """
    profile.COLLECTIVE_SIZES = SMALL_COLLECTIVES
    profile.ALLGATHER_CURVE_SIZES = (2 << 20,)
    profile.SPARSIFY_SIZES = SMALL_SPARSIFY
    profile.DECODE_SIZES = SMALL_DECODE
    ps = None
    if subset is not None:
        ps = hvd.add_process_set(subset)
        if hvd.rank() not in subset:
            hvd.barrier()
            return None
    backward = [1e-4 * (i + 1) for i in range(4)]
    model = profile.measure_cost_model(backward, sparsifier, process_set=ps, density=0.01)
    local = profile.probe_collectives(process_set=ps, sizes_bytes=(4096, 65536), repeats=2,
                                      name="ssf.local")
    if subset is not None:
        hvd.barrier()
    return {"json": model.to_json(), "local": local, "rank": hvd.rank()}

