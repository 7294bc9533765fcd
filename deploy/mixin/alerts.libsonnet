// Alerting rules of the gradwatch mixin (prometheusAlerts): the group gradwatch.alerts of
// deploy/prometheus/gradwatch-rules.yml. Thresholds, durations and what to do for each alert:
// docs/runbook.md. Unit tests: deploy/prometheus/gradwatch-rules.test.yml (promtool).
//
// Conventions:
// * every alert carries `severity` (critical = pages, warning = ticket/chat, no page), and
//   `summary`/`description` naming job, instance and group, and a `runbook_url`;
// * anything that must not be missed between two scrapes (non-finite steps, spikes, isolation
//   violations) is built on gradwatch's counters: a gauge only shows the last collected step, and
//   any PromQL comparison with NaN is false, so `gradwatch_global_grad_norm > x` never sees a NaN;
// * counter alerts are restart-safe: a restarted job on the same address starts its counters
//   again from 0 and shows a new gradwatch_start_time_seconds. When its first scrape already
//   shows an event (old run ended at 1, new run at 1: `increase()` sees 1, 1, 1 and no rise),
//   the counter above 0 in a run whose start time changed in the last N minutes is that event:
//     counter > 0 and on (job, instance)
//       gradwatch_start_time_seconds != last_over_time(gradwatch_start_time_seconds[1h] offset Nm)
//   (last_over_time skips a down target's staleness markers; a start time not seen for an hour
//   is a new series, covered by the `unless present_over_time` clause). The alert descriptions
//   name groups the same way, from the per-group counters, so they still name them after the
//   bad step has passed;
// * ratio levels come from the job's configuration (gradwatch_grad_norm_ratio_band), never from
//   numbers written here;
// * alerts use raw gradwatch series only, never the recording rules, so they do not depend
//   on the evaluation order of the two groups.

local lib = import 'lib.libsonnet';

{
  prometheusAlerts+:: {
    // The settings, and the texts the annotations derive from them.
    local c = $._config + {
      overheadPercent: std.toString(std.round(std.parseJson(super.overheadFraction) * 1e5) / 1e3),
      replicaDivergenceText: lib.numberText(super.replicaDivergenceThreshold),
      updateRatioLowText: lib.numberText(super.updateRatioLow),
      updateRatioHighText: lib.numberText(super.updateRatioHigh),
    } + {
      [key + 'Text']: lib.durationText($._config[key])
      for key in std.objectFields($._config)
      if std.endsWith(key, 'For')
    },
    local runbook(anchor) = c.runbookURLPattern % anchor,
    groups+: [
      group { rules: [lib.rule(r, c) for r in group.rules] }
      for group in [
        {
          name: "gradwatch.alerts",
          rules: [
            // Pages on the first non-finite step: no `for`. Three clauses, each firing for 5 minutes
            // after the new non-finite step is seen: increase() (a rise between two samples; it
            // handles a counter reset); a restart (start time changed, counter above 0: see the
            // header); a new series already above 0 (a first scrape, a pod with a new address).
            {
              alert: "GradwatchNonFiniteGradients",
              expr: |||
                increase(gradwatch_nonfinite_steps_total{@}[5m]) > 0
                or
                (
                  gradwatch_nonfinite_steps_total{@} > 0
                  and on (job, instance)
                  (
                    gradwatch_start_time_seconds{@}
                    != last_over_time(gradwatch_start_time_seconds{@}[1h] offset 5m)
                  )
                )
                or
                (
                  gradwatch_nonfinite_steps_total{@} > 0
                  unless
                  present_over_time(gradwatch_nonfinite_steps_total{@}[1h] offset 5m)
                )
              |||,
              labels: {
                severity: "critical",
              },
              annotations: {
                summary: "Non-finite gradients in job {{ $labels.job }} ({{ $labels.instance }})",
                description: "Job {{ $labels.job }} (instance {{ $labels.instance }}) produced NaN/Inf gradients in the last 5 minutes (gradwatch_nonfinite_steps_total rose). Groups with non-finite gradients in the last 5 minutes (gradwatch_nonfinite_group_steps_total): {{ range $i, $r := printf `increase(gradwatch_nonfinite_group_steps_total{job=%q,instance=%q}[5m]) > 0 or (gradwatch_nonfinite_group_steps_total{job=%q,instance=%q} > 0 and on (job, instance) (gradwatch_start_time_seconds != last_over_time(gradwatch_start_time_seconds[1h] offset 5m))) or (gradwatch_nonfinite_group_steps_total{job=%q,instance=%q} > 0 unless present_over_time(gradwatch_nonfinite_group_steps_total{job=%q,instance=%q}[1h] offset 5m))` $labels.job $labels.instance $labels.job $labels.instance $labels.job $labels.instance $labels.job $labels.instance | query | sortByLabel \"group\" }}{{ if $i }}, {{ end }}{{ $r.Labels.group }}{{ else }}not known (no per-group counter rose){{ end }}.",
                runbook_url: runbook('gradwatchnonfinitegradients'),
              },
            },
            // Adaptive spikes: a step whose norm is far above the group's recent history (the job's
            // spike_threshold, in robust deviations of the log-norm), counted by gradwatch so that a
            // one-step spike between two scrapes is not lost. One alert per group, "(all)" for the
            // global norm; warning, no `for` (a spike is an event), firing for 15 minutes after it.
            // Same three clauses as the non-finite alert: a rise, a restart, a new series above 0.
            {
              alert: "GradwatchGradNormSpike",
              expr: |||
                (
                  increase(gradwatch_grad_norm_spikes_total{@}[15m]) > 0
                  or
                  (
                    gradwatch_grad_norm_spikes_total{@} > 0
                    and on (job, instance)
                    (
                      gradwatch_start_time_seconds{@}
                      != last_over_time(gradwatch_start_time_seconds{@}[1h] offset 15m)
                    )
                  )
                  or
                  (
                    gradwatch_grad_norm_spikes_total{@} > 0
                    unless
                    present_over_time(gradwatch_grad_norm_spikes_total{@}[1h] offset 15m)
                  )
                )
                or
                label_replace(
                  increase(gradwatch_global_grad_norm_spikes_total{@}[15m]) > 0
                  or
                  (
                    gradwatch_global_grad_norm_spikes_total{@} > 0
                    and on (job, instance)
                    (
                      gradwatch_start_time_seconds{@}
                      != last_over_time(gradwatch_start_time_seconds{@}[1h] offset 15m)
                    )
                  )
                  or
                  (
                    gradwatch_global_grad_norm_spikes_total{@} > 0
                    unless
                    present_over_time(gradwatch_global_grad_norm_spikes_total{@}[1h] offset 15m)
                  ),
                  "group", "(all)", "", ""
                )
              |||,
              labels: {
                severity: "warning",
              },
              annotations: {
                summary: "Gradient-norm spike in job {{ $labels.job }} ({{ $labels.instance }}), group {{ $labels.group }}",
                description: "The gradient norm of group {{ $labels.group }} in job {{ $labels.job }} (instance {{ $labels.instance }}) spiked in the last 15 minutes: at least one step far above its recent history (spike score above the job's spike_threshold). Groups with spikes in the last 15 minutes (gradwatch_grad_norm_spikes_total): {{ range $i, $r := printf `increase(gradwatch_grad_norm_spikes_total{job=%q,instance=%q}[15m]) > 0 or (gradwatch_grad_norm_spikes_total{job=%q,instance=%q} > 0 and on (job, instance) (gradwatch_start_time_seconds != last_over_time(gradwatch_start_time_seconds[1h] offset 15m))) or (gradwatch_grad_norm_spikes_total{job=%q,instance=%q} > 0 unless present_over_time(gradwatch_grad_norm_spikes_total{job=%q,instance=%q}[1h] offset 15m))` $labels.job $labels.instance $labels.job $labels.instance $labels.job $labels.instance $labels.job $labels.instance | query | sortByLabel \"group\" }}{{ if $i }}, {{ end }}{{ $r.Labels.group }}{{ else }}none (the global norm only){{ end }}.",
                runbook_url: runbook('gradwatchgradnormspike'),
              },
            },
            // Sustained: a single spiky step does not alert. The per-tensor threshold is the job's
            // GRADWATCH_EXPLODING_THRESHOLD (default 100); the norm threshold is _config.explodingNormThreshold.
            {
              alert: "GradwatchExplodingGradients",
              expr: |||
                gradwatch_exploding_tensors{@} > 0
                or
                gradwatch_grad_norm{@} > $(explodingNormThreshold)
                or
                label_replace(gradwatch_global_grad_norm{@} > $(explodingNormThreshold), "group", "(all)", "", "")
              |||,
              'for': '$(explodingFor)',
              labels: {
                severity: "warning",
              },
              annotations: {
                summary: "Exploding gradients in job {{ $labels.job }} ({{ $labels.instance }}), group {{ $labels.group }}",
                description: "Group {{ $labels.group }} of job {{ $labels.job }} (instance {{ $labels.instance }}) has had exploding gradients for $(explodingForText): parameters above the job's exploding threshold, or a gradient norm above $(explodingNormThreshold) (current value {{ $value | humanize }}).",
                runbook_url: runbook('gradwatchexplodinggradients'),
              },
            },
            // Isolated groups are expected to have no gradient: they are not "vanishing".
            {
              alert: "GradwatchVanishingGradients",
              expr: |||
                gradwatch_vanishing_tensors{@} > 0
                unless on (job, instance, group)
                gradwatch_isolation_violated{@}
              |||,
              'for': '$(vanishingFor)',
              labels: {
                severity: "warning",
              },
              annotations: {
                summary: "Vanishing gradients in job {{ $labels.job }} ({{ $labels.instance }}), group {{ $labels.group }}",
                description: "{{ $value | humanize }} parameter(s) of group {{ $labels.group }} in job {{ $labels.job }} (instance {{ $labels.instance }}) have had a gradient norm below the job's vanishing threshold for $(vanishingForText).",
                runbook_url: runbook('gradwatchvanishinggradients'),
              },
            },
            // The gauge shows the current state; the counter catches a violating step between scrapes.
            {
              alert: "GradwatchIsolationViolated",
              expr: |||
                gradwatch_isolation_violated{@} == 1
                or
                increase(gradwatch_isolation_violations_total{@}[5m]) > 0
                or
                (
                  gradwatch_isolation_violations_total{@} > 0
                  and on (job, instance)
                  (
                    gradwatch_start_time_seconds{@}
                    != last_over_time(gradwatch_start_time_seconds{@}[1h] offset 5m)
                  )
                )
              |||,
              labels: {
                severity: "warning",
              },
              annotations: {
                summary: "Isolation violated in job {{ $labels.job }} ({{ $labels.instance }}), group {{ $labels.group }}",
                description: "Group {{ $labels.group }} of job {{ $labels.job }} (instance {{ $labels.instance }}) is configured as isolated (GRADWATCH_ISOLATED) but received a gradient above the isolation threshold in the last 5 minutes.",
                runbook_url: runbook('gradwatchisolationviolated'),
              },
            },
            // Normalized ratio (numerator per-element norm over denominator per-element norm) below
            // the pair's dormant level (gradwatch_grad_norm_ratio_band{bound="dormant"}, from the
            // job's WatchConfig.ratios; 0 disables). max_over_time ignores NaN samples, so a
            // non-finite step does not restart the timer: the ratio stayed below the level at every
            // sample for 15 minutes (5m window + 10m `for`). An undefined ratio (the denominator
            // group had no usable gradient, e.g. an isolated host) is exported as NaN: a comparison
            // with NaN is false, so it never fires.
            {
              alert: "GradwatchGradRatioDormant",
              expr: |||
                max_over_time(gradwatch_grad_norm_ratio{@}[5m])
                < on (job, instance, numerator, denominator)
                gradwatch_grad_norm_ratio_band{bound="dormant",@}
              |||,
              'for': '$(ratioDormantFor)',
              labels: {
                severity: "warning",
              },
              annotations: {
                summary: "Group {{ $labels.numerator }} is dormant against {{ $labels.denominator }} in job {{ $labels.job }} ({{ $labels.instance }})",
                description: "The normalized gradient ratio of group {{ $labels.numerator }} to group {{ $labels.denominator }} in job {{ $labels.job }} (instance {{ $labels.instance }}) has stayed below its dormant level {{ range printf `gradwatch_grad_norm_ratio_band{job=%q,instance=%q,numerator=%q,denominator=%q,bound=\"dormant\"}` $labels.job $labels.instance $labels.numerator $labels.denominator | query }}{{ printf \"%.3g\" .Value }}{{ end }} for 15 minutes (highest value in the last 5 minutes: {{ printf \"%.3g\" $value }}; configured healthy band {{ range printf `gradwatch_grad_norm_ratio_band{job=%q,instance=%q,numerator=%q,denominator=%q,bound=\"low\"}` $labels.job $labels.instance $labels.numerator $labels.denominator | query }}{{ printf \"%.3g\" .Value }}{{ end }}-{{ range printf `gradwatch_grad_norm_ratio_band{job=%q,instance=%q,numerator=%q,denominator=%q,bound=\"high\"}` $labels.job $labels.instance $labels.numerator $labels.denominator | query }}{{ printf \"%.3g\" .Value }}{{ end }}).",
                runbook_url: runbook('gradwatchgradratiodormant'),
              },
            },
            // Replicas of a data-parallel model must hold identical gradients after the all-reduce.
            // Measured every GRADWATCH_DIVERGENCE_EVERY collections: max_over_time keeps one
            // measurement visible between measurements.
            {
              alert: "GradwatchReplicaDivergence",
              expr: "max_over_time(gradwatch_replica_divergence{@}[5m]) > $(replicaDivergenceThreshold)",
              labels: {
                severity: "critical",
              },
              annotations: {
                summary: "Replica divergence in job {{ $labels.job }} ({{ $labels.instance }})",
                description: "The data-parallel replicas of job {{ $labels.job }} (instance {{ $labels.instance }}) hold different gradients (all groups): relative spread of the replicas' global norms {{ $value | humanize }} > $(replicaDivergenceText).",
                runbook_url: runbook('gradwatchreplicadivergence'),
              },
            },
            // One data-parallel replica's local (pre-reduction) gradient norm far from the others'
            // for 15 minutes: a bad data shard, a misconfigured loader, a faulty device. The score is
            // max |x - median| / median over the replicas (absent without the per-rank view).
            {
              alert: "GradwatchReplicaOutlier",
              expr: "gradwatch_replica_outlier_score{@} > $(replicaOutlierThreshold)",
              'for': '$(replicaOutlierFor)',
              labels: {
                severity: "warning",
              },
              annotations: {
                summary: "Outlier data-parallel replica in job {{ $labels.job }} ({{ $labels.instance }})",
                description: "In job {{ $labels.job }} (instance {{ $labels.instance }}) one replica's local gradient norm (all groups, before the all-reduce) has been more than twice the replicas' median for $(replicaOutlierForText) (outlier score {{ $value | humanize }}). Rank holding the largest norm: {{ range printf \"gradwatch_replica_grad_norm_max_rank{job=%q,instance=%q}\" $labels.job $labels.instance | query }}{{ .Value }}{{ else }}unknown{{ end }}.",
                runbook_url: runbook('gradwatchreplicaoutlier'),
              },
            },
            // The same rank has been the slowest (rank_timing) on every timed step of the window and
            // the straggler score has stayed below the threshold for as long: one rank holds the
            // whole job back. max/min over the window without the host label: one rank id, even
            // if the series' host label changed; steps where no rank stood out are skipped.
            {
              alert: "GradwatchSameRankSlowest",
              expr: "gradwatch_straggler_score{@} < $(stragglerScoreThreshold) and (max without(host) (max_over_time(gradwatch_slowest_rank{@}[$(stragglerFor)])) == min without(host) (min_over_time(gradwatch_slowest_rank{@}[$(stragglerFor)])))",
              'for': '$(stragglerFor)',
              labels: {
                severity: "warning",
              },
              annotations: {
                summary: "One rank is slowing down job {{ $labels.job }} ({{ $labels.instance }})",
                description: "In job {{ $labels.job }} (instance {{ $labels.instance }}) the same rank has been the slowest (working time, all groups) for $(stragglerForText) or more: rank {{ range printf \"gradwatch_slowest_rank{job=%q,instance=%q}\" $labels.job $labels.instance | query }}{{ .Value }} on host {{ .Labels.host }}{{ else }}unknown{{ end }}, straggler score {{ $value | printf \"%.2f\" }} (the fastest rank's working time over its own; below $(stragglerScoreThreshold)).",
                runbook_url: runbook('gradwatchsamerankslowest'),
              },
            },
            // gradwatch itself says it is not measuring: a collect failed (the job's log says why,
            // once) or collection stopped for the rest of the run. Its per-step gauges are absent
            // meanwhile, so no other gradient alert can fire: page at the first scrape, no `for`.
            {
              alert: "GradwatchNotCollecting",
              expr: "gradwatch_collecting{@} == 0",
              labels: {
                severity: "critical",
              },
              annotations: {
                summary: "gradwatch is not measuring gradients in job {{ $labels.job }} ({{ $labels.instance }})",
                description: "gradwatch in job {{ $labels.job }} (instance {{ $labels.instance }}) reports gradwatch_collecting 0: its last collect failed or collection stopped, so the gradient health of all groups is unknown (its per-step metrics are absent). The job's log (logger gradwatch) says why; gradwatch_internal_errors_total says which kind of error.",
                runbook_url: runbook('gradwatchnotcollecting'),
              },
            },
            // The optimizer-step guard (watch.guard) skips steps repeatedly: one skip is the guard
        // working; three in 15 minutes (its reasons; _config.skippedStepsThreshold) mean the data,
        // the LR or the model keeps producing bad steps, and every skipped step is a step the run
        // did not train. Warning, no `for`: the skips already happened.
        {
          alert: "GradwatchStepsSkipped",
          expr: |||
            sum by (job, instance) (increase(gradwatch_skipped_steps_total{reason=~"nonfinite|spike",@}[15m])) >= $(skippedStepsThreshold)
            or
            (
              sum by (job, instance) (gradwatch_skipped_steps_total{reason=~"nonfinite|spike",@}) >= $(skippedStepsThreshold)
              and on (job, instance)
              (
                gradwatch_start_time_seconds{@}
                != last_over_time(gradwatch_start_time_seconds{@}[1h] offset 15m)
              )
            )
          |||,
          labels: {
            severity: "warning",
          },
          annotations: {
            summary: "The guard keeps skipping optimizer steps in job {{ $labels.job }} ({{ $labels.instance }})",
            description: "The optimizer-step guard of job {{ $labels.job }} (instance {{ $labels.instance }}) skipped {{ $value | humanize }} optimizer steps in the last 15 minutes because of non-finite or spiking gradients of the whole model (all groups); gradwatch_skipped_steps_total says which reason.",
            runbook_url: runbook('gradwatchstepsskipped'),
          },
        },
        // Most recent optimizer steps changed nothing outside the guard: the AMP GradScaler or
        // DeepSpeed skipped them on overflows, or the weights did not move although the gradients
        // were finite and non-zero (update_stats: a silent skip). A scaler's occasional overflow
        // is normal; more than half of the collects of 15 minutes (at least
        // _config.optimizerSkippedMinCollects of them) is a run that stopped training. Critical,
        // no `for`. The second clause sees a run that skips from its start at its first scrape:
        // its counters since the start, in a run whose start time changed (a restart, see the
        // header) or first appeared in the last 15 minutes.
        {
          alert: "GradwatchOptimizerNotUpdating",
          expr: |||
            (
              sum by (job, instance) (increase(gradwatch_skipped_steps_total{reason=~"amp_overflow|deepspeed_overflow|no_update",@}[15m]))
              / sum by (job, instance) (increase(gradwatch_collections_total{@}[15m]))
              > $(optimizerSkippedFraction)
              and on (job, instance)
              sum by (job, instance) (increase(gradwatch_collections_total{@}[15m])) >= $(optimizerSkippedMinCollects)
            )
            or
            (
              sum by (job, instance) (gradwatch_skipped_steps_total{reason=~"amp_overflow|deepspeed_overflow|no_update",@})
              / sum by (job, instance) (gradwatch_collections_total{@})
              > $(optimizerSkippedFraction)
              and on (job, instance)
              sum by (job, instance) (gradwatch_collections_total{@}) >= $(optimizerSkippedMinCollects)
              and on (job, instance)
              (
                (
                  gradwatch_start_time_seconds{@}
                  != last_over_time(gradwatch_start_time_seconds{@}[1h] offset 15m)
                )
                or
                (
                  gradwatch_start_time_seconds{@}
                  unless
                  present_over_time(gradwatch_start_time_seconds{@}[1h] offset 15m)
                )
              )
            )
          |||,
          labels: {
            severity: "critical",
          },
          annotations: {
            summary: "The optimizer is not updating the weights in job {{ $labels.job }} ({{ $labels.instance }})",
            description: "In job {{ $labels.job }} (instance {{ $labels.instance }}) the optimizer skipped or changed nothing on {{ $value | humanizePercentage }} of the collected steps of the whole model (all groups): AMP or DeepSpeed overflows, or weights that did not move although the gradients were finite and non-zero. gradwatch_skipped_steps_total says which reason.",
            runbook_url: runbook('gradwatchoptimizernotupdating'),
          },
        },
        // The update-to-weight ratio of a group left its band for $(updateRatioFor): above
        // _config.updateRatioHigh the optimizer rewrites the weights too fast (a learning rate
        // too high, a loss spike coming); between 0 and _config.updateRatioLow it barely moves
        // them. A ratio of exactly 0 (a frozen group, a skipped step) is not this alert's.
        {
          alert: "GradwatchUpdateRatioOutOfBand",
          expr: |||
            gradwatch_update_ratio{@} > $(updateRatioHigh)
            or
            (gradwatch_update_ratio{@} < $(updateRatioLow) and gradwatch_update_ratio{@} > 0)
          |||,
          'for': '$(updateRatioFor)',
          labels: {
            severity: "warning",
          },
          annotations: {
            summary: "Update ratio of group {{ $labels.group }} out of band in job {{ $labels.job }} ({{ $labels.instance }})",
            description: "The optimizer's update-to-weight ratio of group {{ $labels.group }} in job {{ $labels.job }} (instance {{ $labels.instance }}) is {{ $value }}, outside [$(updateRatioLowText), $(updateRatioHighText)] for $(updateRatioForText).",
            runbook_url: runbook('gradwatchupdateratiooutofband'),
          },
        },
        // Most of a group's intended updates are rounded away (bf16/fp16 weights at a small
        // learning rate): the group is not learning although the optimizer runs.
        {
          alert: "GradwatchStalledUpdates",
          expr: "gradwatch_stalled_update_fraction{@} > $(stalledUpdateFraction)",
          'for': '$(stalledUpdatesFor)',
          labels: {
            severity: "warning",
          },
          annotations: {
            summary: "Updates of group {{ $labels.group }} are rounded away in job {{ $labels.job }} ({{ $labels.instance }})",
            description: "{{ $value | humanizePercentage }} of the intended updates of group {{ $labels.group }} in job {{ $labels.job }} (instance {{ $labels.instance }}) were under half an ulp of their weights and left them unchanged, for $(stalledUpdatesForText).",
            runbook_url: runbook('gradwatchstalledupdates'),
          },
        },
        // Steps on which no parameter had a gradient at all (collect() before backward(), or
        // after zero_grad(set_to_none=True)): their norms and health are NaN, so no threshold
        // alert sees them, yet the loop may train nothing. Warning, no `for`: the steps already
        // happened; a new run with such steps fires too.
        {
          alert: "GradwatchNoGradient",
          expr: |||
            increase(gradwatch_no_gradient_steps_total{@}[15m]) > 0
            or
            (
              gradwatch_no_gradient_steps_total{@} > 0
              and on (job, instance)
              (
                gradwatch_start_time_seconds{@}
                != last_over_time(gradwatch_start_time_seconds{@}[1h] offset 15m)
              )
            )
            or
            (
              gradwatch_no_gradient_steps_total{@} > 0
              unless
              present_over_time(gradwatch_no_gradient_steps_total{@}[1h] offset 15m)
            )
          |||,
          labels: {
            severity: "warning",
          },
          annotations: {
            summary: "Steps without any gradient in job {{ $labels.job }} ({{ $labels.instance }})",
            description: "Job {{ $labels.job }} (instance {{ $labels.instance }}) collected steps on which no parameter of the whole model (all groups) had a gradient (gradwatch_no_gradient_steps_total rose): collect() ran before backward() or after zero_grad(set_to_none=True). Their norms and health are NaN, not measured.",
            runbook_url: runbook('gradwatchnogradient'),
          },
        },
        // The guard hit max_consecutive_skips and now applies the bad steps it would skip (a run
        // that skips forever is not training). Critical, no `for`; held 5 minutes after a healthy
        // step re-arms the guard, so a short episode between two scrapes still pages.
        {
          alert: "GradwatchGuardStopped",
          expr: "max_over_time(gradwatch_guard_stopped{@}[5m]) == 1",
          labels: {
            severity: "critical",
          },
          annotations: {
            summary: "The guard stopped skipping bad steps in job {{ $labels.job }} ({{ $labels.instance }})",
            description: "The optimizer-step guard of job {{ $labels.job }} (instance {{ $labels.instance }}) skipped max_consecutive_skips steps in a row and now applies the non-finite or spiking steps of the whole model (all groups) it would skip: the weights may be damaged. gradwatch_consecutive_skipped_steps shows the run of skips.",
            runbook_url: runbook('gradwatchguardstopped'),
          },
        },
        // A norm the training code computes (its clip's return value or its logged grad_norm,
            // audited by GradWatch.audit_norm) keeps disagreeing with gradwatch's exact norm of the
            // same steps: the job clips with, or reports, a wrong norm. Persistent only (a 10-minute
            // increase held for 15 minutes), so a one-off disagreement does not page.
            {
              alert: "GradwatchNormAuditDisagreement",
              expr: |||
                increase(gradwatch_norm_audit_disagreements_total{@}[10m]) > 0
                or
                (
                  gradwatch_norm_audit_disagreements_total{@} > 0
                  and on (job, instance)
                  (
                    gradwatch_start_time_seconds{@}
                    != last_over_time(gradwatch_start_time_seconds{@}[1h] offset 10m)
                  )
                )
              |||,
              'for': '$(normAuditFor)',
              labels: {
                severity: "critical",
              },
              annotations: {
                summary: "The gradient norm computed by {{ $labels.source }} is wrong in job {{ $labels.job }} ({{ $labels.instance }})",
                description: "For $(normAuditForText) the whole-model gradient norm computed by {{ $labels.source }} in job {{ $labels.job }} (instance {{ $labels.instance }}, all groups) has disagreed with gradwatch's exact norm of the same steps (gradwatch_reported_norm_ratio shows reported / exact). The job's log (logger gradwatch) names the likely cause once.",
                runbook_url: runbook('gradwatchnormauditdisagreement'),
              },
            },
            // The target answers but the training loop stopped collecting (hang, deadlock, stuck
            // data loader). Not while the target is down: GradwatchTargetDown covers that.
            {
              alert: "GradwatchMetricsStale",
              expr: |||
                (
                  time() - gradwatch_last_collect_timestamp_seconds{@} > $(metricsStaleSeconds)
                  and
                  gradwatch_last_collect_timestamp_seconds{@} > 0
                )
                and on (job, instance)
                up{@} == 1
              |||,
              'for': '$(metricsStaleFor)',
              labels: {
                severity: "warning",
              },
              annotations: {
                summary: "gradwatch metrics are stale in job {{ $labels.job }} ({{ $labels.instance }})",
                description: "Job {{ $labels.job }} (instance {{ $labels.instance }}) is up but has collected no gradient statistics for {{ $value | humanizeDuration }} (all groups): the training loop is stalled or no longer calls collect().",
                runbook_url: runbook('gradwatchmetricsstale'),
              },
            },
            // Only targets that served gradwatch metrics in the last hour: other jobs' targets are
            // not ours, and a training job that has not opened its port yet (loading) is not down.
            {
              alert: "GradwatchTargetDown",
              expr: |||
                up{@} == 0
                and on (job, instance)
                present_over_time(gradwatch_build_info{@}[1h])
              |||,
              'for': '$(targetDownFor)',
              labels: {
                severity: "warning",
              },
              annotations: {
                summary: "gradwatch target {{ $labels.instance }} of job {{ $labels.job }} is down",
                description: "Prometheus has failed to scrape gradwatch on {{ $labels.instance }} (job {{ $labels.job }}, all groups) for $(targetDownForText): the training job crashed or ended, or the endpoint is unreachable.",
                runbook_url: runbook('gradwatchtargetdown'),
              },
            },
            {
              alert: "GradwatchExporterErrors",
              expr: |||
                increase(gradwatch_publish_errors_total{@}[10m]) > 0
                or
                (
                  gradwatch_publish_errors_total{@} > 0
                  and on (job, instance)
                  (
                    gradwatch_start_time_seconds{@}
                    != last_over_time(gradwatch_start_time_seconds{@}[1h] offset 10m)
                  )
                )
              |||,
              labels: {
                severity: "warning",
              },
              annotations: {
                summary: "gradwatch failed to publish statistics in job {{ $labels.job }} ({{ $labels.instance }})",
                description: "gradwatch in job {{ $labels.job }} (instance {{ $labels.instance }}) failed to build or publish a snapshot in the last 10 minutes (all groups): its metrics may be stale. The job's log names the error.",
                runbook_url: runbook('gradwatchexportererrors'),
              },
            },
            // A sink (the history file, a tracker, a user sink) failed to write or lost steps:
            // its own queue and thread keep the endpoint and the other sinks going, so nothing
            // else shows it. Per sink, on the two counters; restart-safe as the others.
            {
              alert: "GradwatchSinkFailing",
              expr: |||
                (
                  increase(gradwatch_sink_errors_total{@}[10m]) > 0
                  or
                  increase(gradwatch_sink_dropped_steps_total{@}[10m]) > 0
                )
                or
                (
                  (gradwatch_sink_errors_total{@} > 0 or gradwatch_sink_dropped_steps_total{@} > 0)
                  and on (job, instance)
                  (
                    gradwatch_start_time_seconds{@}
                    != last_over_time(gradwatch_start_time_seconds{@}[1h] offset 10m)
                  )
                )
              |||,
              labels: {
                severity: "warning",
              },
              annotations: {
                summary: "gradwatch's {{ $labels.sink }} sink is failing in job {{ $labels.job }} ({{ $labels.instance }})",
                description: "The {{ $labels.sink }} sink of gradwatch in job {{ $labels.job }} (instance {{ $labels.instance }}, all groups) failed to write or lost steps in the last 10 minutes (gradwatch_sink_errors_total, gradwatch_sink_dropped_steps_total): that tracker or history file misses steps, while the endpoint and the other sinks go on. The job's log (logger gradwatch) names the error.",
                runbook_url: runbook('gradwatchsinkfailing'),
              },
            },
            // Fraction of the training thread's wall-clock time spent in collect().
            {
              alert: "GradwatchOverheadHigh",
              expr: "rate(gradwatch_collect_seconds_sum{@}[5m]) > $(overheadFraction)",
              'for': '$(overheadFor)',
              labels: {
                severity: "warning",
              },
              annotations: {
                summary: "gradwatch costs more than $(overheadPercent)% of training time in job {{ $labels.job }} ({{ $labels.instance }})",
                description: "collect() has used {{ $value | humanizePercentage }} of the training thread's time in job {{ $labels.job }} (instance {{ $labels.instance }}, all groups) for $(overheadForText).",
                runbook_url: runbook('gradwatchoverheadhigh'),
              },
            },
          ],
        },
      ]
    ],
  },
}
