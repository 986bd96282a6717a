"""The shared core every scheme is built on (``docs/design.md``):

* :mod:`~ssfusion_hvd.core.layout`: tensors back to back in one flat buffer (the buffer step);
* :mod:`~ssfusion_hvd.core.buffers`: a plan group's fusion buffers, their encode and decode;
* :mod:`~ssfusion_hvd.core.wire`: the one record format of (values, indices) on the wire;
* :mod:`~ssfusion_hvd.core.offload`: SSFusion-O's selection worker thread;
* :mod:`~ssfusion_hvd.core.transport`: the collectives (the only Horovod user besides the optimizer);
* :mod:`~ssfusion_hvd.core.stats`: :class:`StepStats`, what ``stats()`` reports.

``transport`` imports Horovod; the others do not, and are not imported here.
"""
