"""The kopf operator for LoRABase and LoRAAdapter. Reaches server pods only over HTTP.

Import it as ``loraplane.operator``. This folder sits at the repository root, so an interpreter started
there could find it as a top-level ``operator`` ahead of the standard library (``python -m`` puts the
working directory first on sys.path). The guard below makes that import yield the standard library's
module instead; it uses only frozen import machinery, because the stdlib module is not loaded yet.
"""

if __name__ == "operator":
    import _frozen_importlib
    import _frozen_importlib_external
    import os as _os
    import sys as _sys

    _path = _os.path.join(_os.path.dirname(_os.__file__), "operator.py")
    _loader = _frozen_importlib_external.SourceFileLoader("operator", _path)
    _spec = _frozen_importlib_external.spec_from_file_location("operator", _path, loader=_loader)
    _stdlib_operator = _frozen_importlib.module_from_spec(_spec)
    _sys.modules["operator"] = _stdlib_operator
    _loader.exec_module(_stdlib_operator)
