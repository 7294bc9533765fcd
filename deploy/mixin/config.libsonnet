// The mixin's settings: override any of them with `_config+:: { ... }` (docs/operations.md).
{
  _config+:: {
    // Label matchers added to every gradwatch series the rules and the dashboard select, e.g.
    // 'cluster="eu-1"' or 'namespace=~"ml-.*"'. Empty: every series (the shipped files).
    selector: '',

    // Thresholds are PromQL number literals, written as strings so they appear exactly as
    // given (1e-06 stays 1e-06).
    explodingNormThreshold: '1000',  // a group's or the global gradient norm (GradwatchExplodingGradients)
    replicaDivergenceThreshold: '1e-06',  // relative spread of the replicas' norms
    replicaOutlierThreshold: '1',  // max |x - median| / median over the replicas
    stragglerScoreThreshold: '0.7',  // fastest rank's working time / slowest's (rank_timing)
    metricsStaleSeconds: '900',  // seconds without a collect while the target is up
    overheadFraction: '0.05',  // share of the training thread's time in collect()
    skippedStepsThreshold: '3',  // steps the optimizer-step guard skipped in 15 minutes
    optimizerSkippedFraction: '0.5',  // share of collects whose optimizer step changed nothing
    optimizerSkippedMinCollects: '10',  // collects needed before that share is judged (a GradScaler's warm-up)
    updateRatioHigh: '0.01',  // update-to-weight ratio of a group (GradwatchUpdateRatioOutOfBand)
    updateRatioLow: '1e-06',
    stalledUpdateFraction: '0.5',  // share of a group's intended updates rounded away

    // `for` durations of the alerts that have one (the others fire on the first event).
    explodingFor: '5m',
    vanishingFor: '15m',
    ratioDormantFor: '10m',
    replicaOutlierFor: '15m',
    stragglerFor: '10m',  // also the window in which the slowest rank must not change
    normAuditFor: '15m',
    metricsStaleFor: '5m',
    targetDownFor: '5m',
    overheadFor: '15m',
    updateRatioFor: '15m',
    stalledUpdatesFor: '15m',

    // Where each alert's runbook_url points: %s is the alert name in lower case.
    runbookURLPattern: 'docs/runbook.md#%s',

    // The Grafana dashboard.
    dashboardUID: 'gradwatch',
    dashboardTitle: 'gradwatch: gradient health',
  },
}
