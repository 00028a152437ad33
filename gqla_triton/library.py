"""Importing this module registers every ``torch.library`` op of gqla_triton (``torch.ops.gqla_triton.*``: the
public ops and the layers' decode-step ops). ``import gqla_triton`` imports no op module, so a program that names
the ops without calling the package first, such as one saved by ``torch.export.save``, needs
``import gqla_triton.library`` before ``torch.export.load``."""

import importlib

MODULES = ("gqla_triton.ops.gdn.api", "gqla_triton.ops.gdn.decode", "gqla_triton.ops.mla.api",
           "gqla_triton.ops.mla.compat", "gqla_triton.ops.gqa.api", "gqla_triton.layers.gdn_step",
           "gqla_triton.layers.gqla_step")

for _name in MODULES:
    importlib.import_module(_name)
