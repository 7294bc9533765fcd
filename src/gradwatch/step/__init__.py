"""One step's orchestration and decisions: construction (``resolve``), the collector's schedule, the
failure protocol, clipping and the optimizer-step guard."""
