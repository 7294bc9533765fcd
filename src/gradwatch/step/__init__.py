"""One step's orchestration and decisions: construction (``resolve``), the collector's schedule, the
failure protocol, clipping and the optimizer-step guard.

The names of the former module ``gradwatch.step`` (now :mod:`gradwatch.step.collector`) still
resolve here for one release, with a DeprecationWarning.
"""

from gradwatch._moved import old_module_names

__getattr__ = old_module_names(__name__, __path__, "gradwatch.step.collector")
