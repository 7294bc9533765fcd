"""What the ranks agree on and the one collective: the layout, the construction handshake, the
all-reduce and the packing of the reduced vector.

``gradwatch.reduce.Reducer`` and the other names of the former module ``gradwatch.reduce``
(now :mod:`gradwatch.reduce.packing`) still resolve for one release, with a DeprecationWarning.
"""

from gradwatch._moved import old_module_names

__getattr__ = old_module_names(__name__, __path__, "gradwatch.reduce.packing")
