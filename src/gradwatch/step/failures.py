"""The failure protocol of the collects: what a failed local pass, a failed collective or
another rank's failure does, so that every rank's collective sequence stays aligned.

Recovery is safe exactly when this rank issues the same collectives as the others: a failure
before this step's all-reduce issues a failed-marked stand-in of the same shape; after it, the
sequence is already complete. An issued all-reduce is never abandoned: a wait that times out (a
straggler) leaves it in flight, that step is not measured (``collective_timeout``), and the
next collects pair step for step as before. Any figure the ranks' vectors show to be
inconsistent (a rank's failed pass, a closed watcher, ranks that collected different steps)
makes the step not measured and is counted. Collection stops for the rest of the run only when
an all-reduce *failed* (a dead peer, a broken group: every rank sees it at its next collect, see
:meth:`Failures.check_group`) or every rank raises the same error before any collective
(:class:`~gradwatch.errors.UnsupportedParallelismError`). Nothing here raises into training but
the result of a step that was not measured.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from torch import Tensor

from gradwatch.analysis.reporter import Reporter
from gradwatch.errors import GradWatchError, GradWatchTimeoutError, UnsupportedParallelismError
from gradwatch.norms.stats import MetaGradientError
from gradwatch.reduce.packing import Reducer
from gradwatch.reduce.reduced import ReducedStats, ReducedVector
from gradwatch.reduce.steps import steps_differ

if TYPE_CHECKING:
    from gradwatch.step.guard import GuardDecision, StepGuard

log = logging.getLogger("gradwatch")


class Failures:
    """The failure protocol of one watcher's collects (see the module docs).

    Args:
        reducer: the watcher's reducer (its issued count tells whether a failed collect issued
            its own all-reduce).
        local_names: this rank's parameter names, in local order (named in messages).
        reporter: where counters and logs go.
    """

    def __init__(self, reducer: Reducer, local_names: list[str], reporter: Reporter) -> None:
        self._reducer = reducer
        self._local_names = local_names
        self._reporter = reporter
        self.broken: str | None = None  # why collection stopped for the rest of the run
        # Collection stopped on every rank at the same collect (a step mismatch): the bare
        # loop's clip, collective where the stack's is, is then safe on every rank.
        self.stopped_together = False
        self.last_failed_attempt = 0
        self.stand_in: ReducedVector | None = None  # the last failed pass's stand-in

    def failed(
        self,
        step: int,
        exc: Exception,
        issued: int,
        clip: bool = False,
        with_replicas: bool = False,
    ) -> str:
        """A collect whose local pass raised: count and log it, keep the ranks' collective
        sequences aligned (a stand-in all-reduce when this collect issued none), and return
        why the step was not measured."""
        self.stand_in = None
        if isinstance(exc, UnsupportedParallelismError):
            # Raised identically on every rank before any collective (a layout gradwatch
            # cannot count, e.g. a Partial gradient): every rank stops together, no stand-in.
            self.stop("collect", f"{type(exc).__name__}: {exc}", step)
            return f"collection stopped: {self.broken}"
        if isinstance(exc, GradWatchTimeoutError):
            # A clip's all-reduce failed (its wait is bounded by the group's own timeout, so a
            # timeout there is the group's too): the group is broken on every rank.
            self.stop("collective", f"{type(exc).__name__}: {exc}", step)
            return f"collection stopped: {self.broken}"
        kind, why = _classify(exc, self._local_names)
        self._reporter.internal_error(kind)
        if self._reporter.first(kind):
            log.error(
                "gradwatch: collect(step=%d) failed on rank %d (%s): %s; steps are not "
                "measured until it succeeds again (logged once)",
                step,
                self._reporter.rank,
                kind,
                why,
            )
        reducer = self._reducer
        if reducer.issued == issued:
            try:
                self.stand_in = reducer.reduce_failed(
                    step, device_collective=clip, with_replicas=with_replicas
                )
            except Exception as inner:  # never-crash boundary: the stand-in stops collection
                self.stop("collective", f"{type(inner).__name__}: {inner}", step)
        return f"collect(step={step}) failed: {why}"

    def decide_stood_in(self, guard: StepGuard, step: int) -> GuardDecision | None:
        """The optimizer-step guard's decision from this rank's stand-in all-reduce: the very
        vector every other rank decides from (its step slot NaN), so no rank skips, every
        guard's consecutive-skip count returns to 0 and no sample enters a spike window, bit
        for bit alike. None when no stand-in went out, or when its all-reduce failed
        (collection stops, as on the others at their next collect)."""
        if self.stand_in is None:
            return None
        try:
            return guard.decide(self.stand_in)
        except (GradWatchError, RuntimeError) as exc:
            self.stop("collective", f"{type(exc).__name__}: {exc}", step)
            return None

    def stop(self, kind: str, reason: str, step: int) -> None:
        """Stop collecting for the rest of the run (the ranks' collective sequences may have
        diverged): logged once, counted, ``gradwatch_collecting`` 0."""
        if self.broken is None:
            self.broken = reason
            self._reporter.internal_error(kind)
            log.error(
                "gradwatch: collection stopped at step %d on rank %d for the rest of this run "
                "(no per-step metrics from now on): %s",
                step,
                self._reporter.rank,
                reason,
            )

    def stand_in_closed(self, step: int, with_replicas: bool) -> None:
        """A closed watcher keeps its place in the ranks' collective sequence: the all-reduce
        its collect would have issued, zeros with ``-inf`` in the step slot, so every other
        rank reports the step as not measured ("another rank closed its watcher") instead of
        waiting for a collective that never comes. (Its clips still measure and clip in full:
        the others' clip norms need this rank's squares.)"""
        try:
            self._reducer.reduce_failed(
                step, device_collective=False, with_replicas=with_replicas, marker=-math.inf
            )
        except Exception as exc:  # never-crash boundary: the stand-in stops collection
            self.stop("collective", f"{type(exc).__name__}: {exc}", step)

    def check_group(self, step: int) -> None:
        """Before a collect: stop when an all-reduce this rank issued earlier failed (checked
        without waiting), so ranks that never read their results stop as the publishing one
        does, each at its next collect; then the last one's step agreement
        (:meth:`check_steps`)."""
        if self.broken is None:
            why = self._reducer.collective.failure()
            if why is not None:
                self.stop("collective", f"an earlier all-reduce failed: {why}", step)
        self.check_steps(step)

    def check_steps(self, step: int, ready_only: bool = False) -> None:
        """Before a collect issues its all-reduce: did the ranks collect the same step in the
        last one this rank issued? Read from the reduced step residues
        (:func:`~gradwatch.reduce.steps.steps_differ`), the same answer on every rank; waits for it
        at most ``collective_timeout_seconds`` (it normally completed during this step's
        backward). A mismatch stops collection here, on every rank at this same point (each
        checks that all-reduce before issuing the next), so no all-reduce is left unpaired;
        clips then take the bare loop's clip and guards apply the bare step. Still in flight
        after the wait (a straggler): not checked. ``ready_only``: check only a host-memory
        vector (a clip's or guard's all-reduce on gloo, already awaited; a device one is
        checked at the next collect: reading it now would sync)."""
        reducer = self._reducer
        last = reducer.unchecked
        if last is None or self.broken is not None or (ready_only and not last.on_cpu):
            return
        reducer.unchecked = None
        try:
            _, residue, square = last.step_sums(reducer.timeout)
        except GradWatchError as exc:
            if not getattr(exc, "in_flight", False):
                return  # a stand-in or a failed all-reduce: reported where it is read
            self._reporter.log_once(
                "steps-unchecked",
                "gradwatch: step %d: the previous all-reduce is still in flight after "
                "collective_timeout_seconds (a straggling rank); its step agreement is not "
                "checked (logged once)",
                step,
            )
            return
        ranks = last.ranks if last.ranks is not None else reducer.layout.world_size
        if steps_differ(ranks, residue, square):
            self.stop(
                "step_mismatch",
                f"the ranks collected different steps at one all-reduce (this rank's step "
                f"{last.step}; a rank skipped or repeated a collect): every rank stops "
                "collecting at the same point, clips take the bare loop's clip",
                step,
            )
            self.stopped_together = True

    def settle_clip(self, step: int, total: Tensor | None, decided: bool) -> Tensor | None:
        """After a clip's or guard's pass: on gloo its all-reduce was awaited, so its step
        agreement is known now at no cost, on every rank alike (:meth:`check_steps`). The
        clip's norm, or None when that stopped collection (the clip left the gradients alone:
        the bare loop clips)."""
        if total is None and not decided:
            return None
        self.check_steps(step, ready_only=True)
        return None if self.stopped_together else total

    def measured(self, attempt: int) -> None:
        """A step was measured: collecting again, unless a later collect already failed (the
        publisher builds results after the training thread moved on)."""
        if self.broken is None and attempt > self.last_failed_attempt:
            self._reporter.collecting(True)

    def reduced_stats(self, reduced: ReducedVector, step: int) -> ReducedStats:
        """Wait for the reduced figures of ``step``: the collective timing out stops
        collection; another rank's failed local pass means the step was not measured."""
        try:
            stats = reduced.stats()
        except GradWatchTimeoutError as exc:
            if getattr(exc, "in_flight", False):
                # A straggler: the all-reduce stays issued and completes when it arrives; only
                # this step goes unmeasured.
                self._reporter.internal_error("collective_timeout")
                self._reporter.log_once(
                    "collective-timeout",
                    "gradwatch: step %d was not measured: its all-reduce did not complete "
                    "within collective_timeout_seconds (a straggling rank); it stays issued and "
                    "the next steps are measured again (logged once)",
                    step,
                )
                raise
            self.stop("collective", f"{type(exc).__name__}: {exc}", step)
            raise
        except GradWatchError:
            self._reporter.internal_error("host_copy")
            raise
        if stats.steps_agree(step):  # so no rank failed (NaN) nor closed (-inf): measured
            return stats
        if stats.failed_rank:
            self._reporter.internal_error("other_rank")
            raise GradWatchError(
                f"gradwatch: step {step} was not measured: another rank's local pass failed "
                "(its log says why)"
            )
        if stats.closed_rank:
            self._reporter.internal_error("other_rank_closed")
            raise GradWatchError(
                f"gradwatch: step {step} was not measured: another rank closed its watcher"
            )
        self._reporter.internal_error("step_mismatch")  # finite, but not this step's sum
        self._reporter.log_once(
            "step-mismatch",
            "gradwatch: ranks called collect() with different steps (rank %d: %d); such "
            "steps are not measured (logged once)",
            self._reporter.rank,
            step,
        )
        raise GradWatchError(
            f"gradwatch: step {step} was not measured: the ranks collected different steps "
            f"(the step slot sums to {stats.step_check})"
        )


class Replaced(GradWatchError):
    """A parameter was replaced in its module after construction (see ParameterSlots)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _classify(exc: Exception, local_names: list[str]) -> tuple[str, str]:
    """``(kind, reason)`` of a failed local pass: the ``kind`` label of
    ``gradwatch_internal_errors_total`` and a sentence naming the parameter and the fix."""
    if isinstance(exc, Replaced):
        return "parameters_replaced", (
            f"parameter {exc.name!r} was replaced in its module after GradWatch was built "
            "(to_empty() from meta, load_state_dict(assign=True), or assigning a new "
            "nn.Parameter); construct GradWatch after the model is materialized and loaded"
        )
    if isinstance(exc, MetaGradientError):
        name = local_names[exc.position]
        return "meta_gradient", (
            f"the gradient of parameter {name!r} is on the meta device; materialize the model "
            "(to_empty() and initialization) before training, and construct GradWatch after it"
        )
    return "collect", f"{type(exc).__name__}: {exc}"
