// Recording rules of the gradwatch mixin (prometheusRules): the groups gradwatch.recording and
// gradwatch.fleet of deploy/prometheus/gradwatch-rules.yml.
local lib = import 'lib.libsonnet';

{
  prometheusRules+:: {
    local c = $._config,
    groups+: [
      group { rules: [lib.rule(r, c) for r in group.rules] }
      for group in [
        {
          name: "gradwatch.recording",
          rules: [
            // Finite samples only (a comparison with +Inf drops NaN and +Inf): one non-finite step
            // would otherwise turn the 5-minute averages into NaN for 5 minutes.
            {
              record: "job_instance:gradwatch_global_grad_norm:finite",
              expr: "gradwatch_global_grad_norm{@} < +Inf",
            },
            {
              record: "job_instance:gradwatch_global_grad_norm:avg_over_time_5m",
              expr: "avg_over_time(job_instance:gradwatch_global_grad_norm:finite[5m])",
            },
            {
              record: "job_instance_group:gradwatch_grad_norm:finite",
              expr: "gradwatch_grad_norm{@} < +Inf",
            },
            {
              record: "job_instance_group:gradwatch_grad_norm:avg_over_time_5m",
              expr: "avg_over_time(job_instance_group:gradwatch_grad_norm:finite[5m])",
            },
            {
              record: "job_instance_ratio:gradwatch_grad_norm_ratio:finite",
              expr: "gradwatch_grad_norm_ratio{@} < +Inf",
            },
            {
              record: "job_instance_ratio:gradwatch_grad_norm_ratio:avg_over_time_5m",
              expr: "avg_over_time(job_instance_ratio:gradwatch_grad_norm_ratio:finite[5m])",
            },
          ],
        },
        // Across jobs: a handful of series per Prometheus however many jobs it scrapes, for a global
        // view by federation or remote-write (docs/scale.md). Built on raw gradwatch series only.
        {
          name: "gradwatch.fleet",
          rules: [
            {
              record: "gradwatch:jobs:count",
              expr: "count(gradwatch_collecting{@})",
            },
            {
              record: "gradwatch:jobs_collecting:sum",
              expr: "sum(gradwatch_collecting{@})",
            },
            {
              record: "gradwatch:jobs_with_nonfinite_steps_1h:count",
              expr: "count(increase(gradwatch_nonfinite_steps_total{@}[1h]) > 0) or vector(0)",
            },
            {
              record: "parallelism:gradwatch_jobs:count",
              expr: "count by (parallelism) (gradwatch_run_info{@})",
            },
          ],
        },
      ]
    ],
  },
}
