"""gradwatch's benchmarks: ``python benchmarks/run.py --out docs/performance.md`` (``make bench``).

* :mod:`benchmarks.cases`: what is measured: the gradient and model workloads, the compared
  ways to get a total norm, the kinds of distributed step, the targets, the run plans.
* :mod:`benchmarks.results`: what a run found, as typed values (no torch).
* :mod:`benchmarks.measure`: timing (interleaved rounds, medians, quartiles), op counts, and the
  single-process measurements.
* :mod:`benchmarks.distributed`: the multi-process measurements and their spawned workers.
* :mod:`benchmarks.rankview_bench`: the per-rank view's cost on DDP, the default DDP path's
  saving (no all-reduce under pure replication) over ``always_reduce=True``, and a
  benchmark-only prototype (a post-reduction pass in the comm hook's callback).
* :mod:`benchmarks.report`: the markdown of docs/performance.md, from the results alone:
  figures, targets and verdicts (how each section measures: docs/benchmarks.md, by hand).
* :mod:`benchmarks.norm_report`: its single-process norm sections (per-collect cost, mixed
  sizes, clipping, host reads and ops per collect) and their targets rows.
* :mod:`benchmarks.page`: the page's building blocks (number formats, tables, verdicts, links
  to docs/benchmarks.md, the machine).
* the other ``*_bench`` modules and :mod:`benchmarks.shapes`: one section each, with its
  measurement and, for most, its own result type and markdown.
* :mod:`benchmarks.run`: the command line.
"""
