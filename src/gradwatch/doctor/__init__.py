"""``gradwatch doctor``'s checks (CPU and CUDA) and options, and the instruments behind the cost
claims (timing harness, op and host-read counters).

The names of the former module ``gradwatch.doctor`` (now :mod:`gradwatch.doctor.checks`) still
resolve here for one release, with a DeprecationWarning.
"""

from gradwatch._moved import old_module_names

__getattr__ = old_module_names(__name__, __path__, "gradwatch.doctor.checks")
