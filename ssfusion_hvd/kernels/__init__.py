"""The kernels, one module per family of ``csrc/``, each op with its native and its torch
implementation; ``ssfusion_hvd.ops`` is their one name (its docstring has the shared
semantics)."""
