// The Grafana dashboard of the gradwatch mixin (grafanaDashboards).
//
// The panels (dashboards/gradwatch.libsonnet) select `job=~"$job",instance=~"$instance"`; the
// _config selector is added to every query and to the variables' queries. The norm panels also
// show exemplars: an exemplar-only query (a comparison no sample passes, so it draws no line)
// on the non-finite and spike counters, whose exemplars name the step (and the origin rank) of
// each NaN and spike (docs/metrics.md).
local base = import 'dashboards/gradwatch.libsonnet';

{
  grafanaDashboards+:: {
    local c = $._config,
    local extra = if c.selector == '' then '' else ',' + c.selector,
    local panelSelector = 'job=~"$job",instance=~"$instance"' + extra,
    local select(expr) = std.strReplace(expr, 'job=~"$job",instance=~"$instance"', panelSelector),

    // Exemplar-only queries of the norm panels, by panel title.
    local exemplarCounters = {
      'Global gradient norm': [
        'gradwatch_nonfinite_steps_total',
        'gradwatch_global_grad_norm_spikes_total',
      ],
      'Gradient norm by group': [
        'gradwatch_nonfinite_group_steps_total',
        'gradwatch_grad_norm_spikes_total',
      ],
    },
    local exemplarTarget(counters) = {
      datasource: { type: 'prometheus', uid: '${datasource}' },
      expr: '(' + std.join(' or ', [m + '{' + panelSelector + '}' for m in counters]) + ') < 0',
      exemplar: true,
      range: true,
      instant: false,
      legendFormat: 'step {{step}}',
      refId: 'X',
    },
    local panel(p) =
      p
      + (if std.objectHas(p, 'targets') then {
           targets: [t + (if std.objectHas(t, 'expr') then { expr: select(t.expr) } else {}) for t in p.targets]
                    + (if std.objectHas(exemplarCounters, p.title) then [exemplarTarget(exemplarCounters[p.title])] else []),
         } else {})
      + (if std.objectHas(p, 'panels') then { panels: [panel(q) for q in p.panels] } else {}),
    local variable(v) =
      v
      + (if v.name == 'job' && extra != '' then {
           query: 'label_values(gradwatch_build_info{' + c.selector + '}, job)',
           definition: self.query,
         } else if v.name == 'instance' then {
           query: 'label_values(gradwatch_build_info{job=~"$job"' + extra + '}, instance)',
           definition: self.query,
         } else {}),

    'gradwatch-dashboard.json': base {
      uid: c.dashboardUID,
      title: c.dashboardTitle,
      panels: [panel(p) for p in base.panels],
      templating+: { list: [variable(v) for v in base.templating.list] },
    },
  },
}
