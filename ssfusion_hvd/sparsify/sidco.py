"""SIDCo (Abdelmoniem et al., "An Efficient Statistical-based Gradient Compression
Technique for Distributed Training Systems", MLSys'21), exponential fit, multi-stage.

|x| is modelled as exponential: P(|x| > t) = exp(-t / mean|x|), so the threshold keeping a
fraction delta is mean|x| * ln(1/delta). One fit is poor in the far tail, so the fit is
repeated ``stages`` times, each on the exceedances over the previous threshold (the
exponential is memoryless: exceedances are again exponential), each stage keeping
delta = d^(1/stages). The fit is approximate (a mixture of layers with different scales is
not one exponential), so the stages are bounded by the data: a stage that would keep fewer
than k elements is not taken, and the last selection holding at least k is trimmed to the
exact top-k among its elements (a selection over a small fraction of n, not over n).

Density tolerance: exact — k elements every call.
"""
from __future__ import annotations

import math

from .. import ops
from .base import Sparsifier, check_request, trim


class SIDCo(Sparsifier):
    name = "sidco"

    def __init__(self, stages: int = 3):
        self.stages = stages

    def select(self, x, k):
        k = check_request(x, k)
        n = x.numel()
        keep = math.log(n / k) / self.stages  # ln(1/delta) per stage
        values, indices = x.reshape(-1), None  # the current stage's selection (>= k elements)
        thr = 0.0
        for _ in range(self.stages):
            # finite values only feed the fit (Inf/NaN are still selected: they exceed thr)
            excess = values.float().abs().nan_to_num(nan=0.0, posinf=0.0) - thr
            thr = thr + float(excess.clamp_min(0).mean()) * keep
            v, i = ops.threshold_select(values, thr)
            if v.numel() < k:
                break  # this stage over-shot: keep the previous stage's superset
            indices = i if indices is None else indices[i.long()]
            values = v
        if indices is None:  # the first fit already kept fewer than k
            return ops.topk(x, k)
        return trim(values, indices.to(ops.index_dtype(n)), k)
