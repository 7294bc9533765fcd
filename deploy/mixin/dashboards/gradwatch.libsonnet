// The gradwatch dashboard's panels and layout (a Grafana JSON model); dashboards.libsonnet
// applies the _config (selector, uid, title) and adds the exemplar queries.
{
  "uid": "gradwatch",
  "title": "gradwatch: gradient health",
  "description": "Gradient norms, ratios, anomalies and gradwatch's own cost for torchrun jobs instrumented with gradwatch. Smoothed lines need the recording rules of deploy/prometheus/gradwatch-rules.yml.",
  "tags": [
    "gradwatch",
    "training",
    "pytorch"
  ],
  "schemaVersion": 39,
  "version": 2,
  "editable": true,
  "graphTooltip": 1,
  "refresh": "10s",
  "time": {
    "from": "now-1h",
    "to": "now"
  },
  "timepicker": {},
  "timezone": "browser",
  "fiscalYearStartMonth": 0,
  "liveNow": false,
  "links": [],
  "id": null,
  "annotations": {
    "list": [
      {
        "builtIn": 1,
        "datasource": {
          "type": "grafana",
          "uid": "-- Grafana --"
        },
        "enable": true,
        "hide": true,
        "iconColor": "rgba(0, 211, 255, 1)",
        "name": "Annotations & Alerts",
        "type": "dashboard"
      },
      {
        "name": "Non-finite steps",
        "datasource": {
          "type": "prometheus",
          "uid": "${datasource}"
        },
        "enable": true,
        "hide": false,
        "iconColor": "red",
        "expr": "increase(gradwatch_nonfinite_steps_total{job=~\"$job\",instance=~\"$instance\"}[1m]) > 0",
        "step": "15s",
        "titleFormat": "Non-finite gradients",
        "textFormat": "{{instance}}: NaN/Inf gradients (GradwatchNonFiniteGradients pages)",
        "tagKeys": "job,instance",
        "useValueForTime": false
      },
      {
        "name": "Gradient-norm spikes",
        "datasource": {
          "type": "prometheus",
          "uid": "${datasource}"
        },
        "enable": true,
        "hide": false,
        "iconColor": "purple",
        "expr": "increase(gradwatch_grad_norm_spikes_total{job=~\"$job\",instance=~\"$instance\"}[1m]) > 0",
        "step": "15s",
        "titleFormat": "Gradient-norm spike",
        "textFormat": "{{instance}} group {{group}}: norm far above its recent history (GradwatchGradNormSpike)",
        "tagKeys": "job,instance,group",
        "useValueForTime": false
      },
      {
        "name": "Global gradient-norm spikes",
        "datasource": {
          "type": "prometheus",
          "uid": "${datasource}"
        },
        "enable": true,
        "hide": false,
        "iconColor": "purple",
        "expr": "increase(gradwatch_global_grad_norm_spikes_total{job=~\"$job\",instance=~\"$instance\"}[1m]) > 0",
        "step": "15s",
        "titleFormat": "Global gradient-norm spike",
        "textFormat": "{{instance}}: global norm far above its recent history (GradwatchGradNormSpike)",
        "tagKeys": "job,instance",
        "useValueForTime": false
      },
      {
        "name": "gradwatch alerts firing",
        "datasource": {
          "type": "prometheus",
          "uid": "${datasource}"
        },
        "enable": true,
        "hide": false,
        "iconColor": "orange",
        "expr": "ALERTS{alertname=~\"Gradwatch.*\",alertstate=\"firing\",job=~\"$job\"}",
        "step": "15s",
        "titleFormat": "{{alertname}}",
        "textFormat": "{{severity}} {{instance}} {{group}}",
        "tagKeys": "alertname,severity",
        "useValueForTime": false
      },
      {
        "name": "Guard-skipped steps",
        "datasource": {
          "type": "prometheus",
          "uid": "${datasource}"
        },
        "enable": true,
        "hide": false,
        "iconColor": "orange",
        "expr": "increase(gradwatch_skipped_steps_total{job=~\"$job\",instance=~\"$instance\"}[1m]) > 0",
        "step": "15s",
        "titleFormat": "Optimizer step skipped",
        "textFormat": "{{instance}}: the guard skipped a step ({{reason}}; GradwatchStepsSkipped when it repeats)",
        "tagKeys": "job,instance,reason",
        "useValueForTime": false
      }
    ]
  },
  "templating": {
    "list": [
      {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "includeAll": false,
        "multi": false,
        "options": [],
        "refresh": 1,
        "regex": "",
        "skipUrlSync": false
      },
      {
        "name": "job",
        "label": "Job",
        "type": "query",
        "datasource": {
          "type": "prometheus",
          "uid": "${datasource}"
        },
        "query": "label_values(gradwatch_build_info, job)",
        "definition": "label_values(gradwatch_build_info, job)",
        "current": {},
        "hide": 0,
        "includeAll": false,
        "multi": false,
        "options": [],
        "refresh": 2,
        "regex": "",
        "sort": 1,
        "skipUrlSync": false
      },
      {
        "name": "instance",
        "label": "Instance (rank 0)",
        "type": "query",
        "datasource": {
          "type": "prometheus",
          "uid": "${datasource}"
        },
        "query": "label_values(gradwatch_build_info{job=~\"$job\"}, instance)",
        "definition": "label_values(gradwatch_build_info{job=~\"$job\"}, instance)",
        "current": {},
        "hide": 0,
        "includeAll": true,
        "allValue": ".*",
        "multi": true,
        "options": [],
        "refresh": 2,
        "regex": "",
        "sort": 1,
        "skipUrlSync": false
      }
    ]
  },
  "panels": [
    {
      "id": 1,
      "type": "stat",
      "title": "Health score",
      "description": "gradwatch_health_score: 1 - 0.5*vanishing/n - 0.8*exploding/n over the n parameters with a gradient; 0 on a non-finite step.",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 0,
        "y": 0,
        "w": 4,
        "h": 4
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_health_score{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "{{instance}}",
          "refId": "A",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "percentunit",
          "min": 0,
          "max": 1,
          "decimals": 0,
          "thresholds": {
            "mode": "absolute",
            "steps": [
              {
                "color": "red",
                "value": null
              },
              {
                "color": "orange",
                "value": 0.5
              },
              {
                "color": "green",
                "value": 0.9
              }
            ]
          }
        },
        "overrides": []
      },
      "options": {
        "reduceOptions": {
          "calcs": [
            "lastNotNull"
          ],
          "fields": "",
          "values": false
        },
        "colorMode": "background",
        "graphMode": "none",
        "justifyMode": "auto",
        "textMode": "auto",
        "orientation": "auto"
      }
    },
    {
      "id": 2,
      "type": "stat",
      "title": "Step",
      "description": "Last collected training step (gradwatch_step).",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 4,
        "y": 0,
        "w": 4,
        "h": 4
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_step{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "{{instance}}",
          "refId": "A",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "locale",
          "decimals": 0,
          "thresholds": {
            "mode": "absolute",
            "steps": [
              {
                "color": "blue",
                "value": null
              }
            ]
          }
        },
        "overrides": []
      },
      "options": {
        "reduceOptions": {
          "calcs": [
            "lastNotNull"
          ],
          "fields": "",
          "values": false
        },
        "colorMode": "value",
        "graphMode": "none",
        "justifyMode": "auto",
        "textMode": "value",
        "orientation": "auto"
      }
    },
    {
      "id": 3,
      "type": "stat",
      "title": "Steps per second",
      "description": "Training steps per second, from the collected step numbers.",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 8,
        "y": 0,
        "w": 4,
        "h": 4
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "clamp_min(deriv(gradwatch_step{job=~\"$job\",instance=~\"$instance\"}[$__rate_interval]), 0)",
          "legendFormat": "{{instance}}",
          "refId": "A",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "suffix:steps/s",
          "decimals": 2,
          "thresholds": {
            "mode": "absolute",
            "steps": [
              {
                "color": "blue",
                "value": null
              }
            ]
          }
        },
        "overrides": []
      },
      "options": {
        "reduceOptions": {
          "calcs": [
            "lastNotNull"
          ],
          "fields": "",
          "values": false
        },
        "colorMode": "value",
        "graphMode": "none",
        "justifyMode": "auto",
        "textMode": "value",
        "orientation": "auto"
      }
    },
    {
      "id": 4,
      "type": "stat",
      "title": "Non-finite steps",
      "description": "Steps with NaN/Inf gradients in the dashboard's time range (gradwatch_nonfinite_steps_total; AMP-skipped steps are not counted). Counted per run (run_id), so a restarted job's steps counted before its first scrape are included: the sum over runs of each run's highest count, minus the count at the start of the range.",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 12,
        "y": 0,
        "w": 3,
        "h": 4
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "round(sum by (job, instance) (max_over_time((gradwatch_nonfinite_steps_total{job=~\"$job\",instance=~\"$instance\"} * on (job, instance) group_left (run_id) gradwatch_run_info{job=~\"$job\",instance=~\"$instance\"})[$__range:])) - (sum by (job, instance) (gradwatch_nonfinite_steps_total{job=~\"$job\",instance=~\"$instance\"} offset $__range) or sum by (job, instance) (gradwatch_nonfinite_steps_total{job=~\"$job\",instance=~\"$instance\"}) * 0))",
          "legendFormat": "{{instance}}",
          "refId": "A",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "short",
          "decimals": 0,
          "thresholds": {
            "mode": "absolute",
            "steps": [
              {
                "color": "green",
                "value": null
              },
              {
                "color": "red",
                "value": 1
              }
            ]
          }
        },
        "overrides": []
      },
      "options": {
        "reduceOptions": {
          "calcs": [
            "lastNotNull"
          ],
          "fields": "",
          "values": false
        },
        "colorMode": "background",
        "graphMode": "none",
        "justifyMode": "auto",
        "textMode": "auto",
        "orientation": "auto"
      }
    },
    {
      "id": 5,
      "type": "stat",
      "title": "Exploding steps",
      "description": "Steps with exploding gradients in the dashboard's time range (gradwatch_exploding_steps_total). Counted per run (run_id), so a restarted job's steps counted before its first scrape are included: the sum over runs of each run's highest count, minus the count at the start of the range.",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 15,
        "y": 0,
        "w": 3,
        "h": 4
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "round(sum by (job, instance) (max_over_time((gradwatch_exploding_steps_total{job=~\"$job\",instance=~\"$instance\"} * on (job, instance) group_left (run_id) gradwatch_run_info{job=~\"$job\",instance=~\"$instance\"})[$__range:])) - (sum by (job, instance) (gradwatch_exploding_steps_total{job=~\"$job\",instance=~\"$instance\"} offset $__range) or sum by (job, instance) (gradwatch_exploding_steps_total{job=~\"$job\",instance=~\"$instance\"}) * 0))",
          "legendFormat": "{{instance}}",
          "refId": "A",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "short",
          "decimals": 0,
          "thresholds": {
            "mode": "absolute",
            "steps": [
              {
                "color": "green",
                "value": null
              },
              {
                "color": "orange",
                "value": 1
              }
            ]
          }
        },
        "overrides": []
      },
      "options": {
        "reduceOptions": {
          "calcs": [
            "lastNotNull"
          ],
          "fields": "",
          "values": false
        },
        "colorMode": "background",
        "graphMode": "none",
        "justifyMode": "auto",
        "textMode": "auto",
        "orientation": "auto"
      }
    },
    {
      "id": 6,
      "type": "stat",
      "title": "Target",
      "description": "Prometheus scrape of the rank-0 endpoint.",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 18,
        "y": 0,
        "w": 3,
        "h": 4
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "up{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "{{instance}}",
          "refId": "A",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "bool_on_off",
          "mappings": [
            {
              "type": "value",
              "options": {
                "0": {
                  "text": "DOWN",
                  "color": "red"
                },
                "1": {
                  "text": "UP",
                  "color": "green"
                }
              }
            }
          ],
          "thresholds": {
            "mode": "absolute",
            "steps": [
              {
                "color": "red",
                "value": null
              },
              {
                "color": "green",
                "value": 1
              }
            ]
          }
        },
        "overrides": []
      },
      "options": {
        "reduceOptions": {
          "calcs": [
            "lastNotNull"
          ],
          "fields": "",
          "values": false
        },
        "colorMode": "background",
        "graphMode": "none",
        "justifyMode": "auto",
        "textMode": "auto",
        "orientation": "auto"
      }
    },
    {
      "id": 7,
      "type": "stat",
      "title": "Run",
      "description": "World size, detected parallelism and run identity (gradwatch_run_info; run_id changes at every restart), gradwatch and torch versions (gradwatch_build_info).",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 21,
        "y": 0,
        "w": 3,
        "h": 4
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_run_info{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "{{parallelism}} x{{world_size}}, run {{run_id}}",
          "refId": "A",
          "range": true,
          "instant": false
        },
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_build_info{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "gradwatch {{version}}, torch {{torch_version}}",
          "refId": "B",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "short",
          "thresholds": {
            "mode": "absolute",
            "steps": [
              {
                "color": "blue",
                "value": null
              }
            ]
          }
        },
        "overrides": []
      },
      "options": {
        "reduceOptions": {
          "calcs": [
            "lastNotNull"
          ],
          "fields": "",
          "values": false
        },
        "colorMode": "value",
        "graphMode": "none",
        "justifyMode": "auto",
        "textMode": "name",
        "orientation": "auto"
      }
    },
    {
      "id": 8,
      "type": "timeseries",
      "title": "Global gradient norm",
      "description": "L2 norm over all parameters (log scale); the smoothed line is the 5-minute average of finite samples (recording rule). Gaps: non-finite steps.",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 0,
        "y": 4,
        "w": 12,
        "h": 8
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_global_grad_norm{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "{{instance}}",
          "refId": "A",
          "range": true,
          "instant": false
        },
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "job_instance:gradwatch_global_grad_norm:avg_over_time_5m{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "{{instance}} 5m avg",
          "refId": "B",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "sci",
          "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": false,
            "axisPlacement": "auto",
            "thresholdsStyle": {
              "mode": "off"
            },
            "stacking": {
              "mode": "none",
              "group": "A"
            },
            "scaleDistribution": {
              "type": "log",
              "log": 10
            }
          },
          "decimals": 2
        },
        "overrides": []
      },
      "options": {
        "legend": {
          "displayMode": "table",
          "placement": "bottom",
          "showLegend": true,
          "calcs": [
            "lastNotNull",
            "max"
          ]
        },
        "tooltip": {
          "mode": "multi",
          "sort": "desc"
        }
      }
    },
    {
      "id": 9,
      "type": "timeseries",
      "title": "Gradient norm by group",
      "description": "L2 norm of each group's gradients (log scale), raw and 5-minute average. Isolated groups should stay at 0 (not drawn on a log axis).",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 12,
        "y": 4,
        "w": 12,
        "h": 8
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_grad_norm{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "{{group}}",
          "refId": "A",
          "range": true,
          "instant": false
        },
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "job_instance_group:gradwatch_grad_norm:avg_over_time_5m{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "{{group}} 5m avg",
          "refId": "B",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "sci",
          "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": false,
            "axisPlacement": "auto",
            "thresholdsStyle": {
              "mode": "off"
            },
            "stacking": {
              "mode": "none",
              "group": "A"
            },
            "scaleDistribution": {
              "type": "log",
              "log": 10
            }
          },
          "decimals": 2
        },
        "overrides": []
      },
      "options": {
        "legend": {
          "displayMode": "table",
          "placement": "bottom",
          "showLegend": true,
          "calcs": [
            "lastNotNull",
            "max"
          ]
        },
        "tooltip": {
          "mode": "multi",
          "sort": "desc"
        }
      }
    },
    {
      "id": 10,
      "type": "timeseries",
      "title": "Normalized gradient ratios",
      "description": "(numerator norm / sqrt(numel)) / (denominator norm / sqrt(numel)), log scale. The dashed lines are each pair's configured band (gradwatch_grad_norm_ratio_band, from WatchConfig.ratios; defaults 0.05-0.2 healthy, dormant below 0.01): green = healthy band low/high, red = dormant level (GradwatchGradRatioDormant after 15 min below it). An undefined ratio (denominator without gradient) is NaN: a gap, never 0.",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 0,
        "y": 12,
        "w": 12,
        "h": 8
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_grad_norm_ratio{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "{{numerator}}/{{denominator}}",
          "refId": "A",
          "range": true,
          "instant": false
        },
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "job_instance_ratio:gradwatch_grad_norm_ratio:avg_over_time_5m{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "{{numerator}}/{{denominator}} 5m avg",
          "refId": "B",
          "range": true,
          "instant": false
        },
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_grad_norm_ratio_band{job=~\"$job\",instance=~\"$instance\",bound=~\"low|high\"}",
          "legendFormat": "{{numerator}}/{{denominator}} healthy {{bound}}",
          "refId": "C",
          "range": true,
          "instant": false
        },
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_grad_norm_ratio_band{job=~\"$job\",instance=~\"$instance\",bound=\"dormant\"}",
          "legendFormat": "{{numerator}}/{{denominator}} dormant below",
          "refId": "D",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "sci",
          "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 0,
            "showPoints": "never",
            "spanNulls": false,
            "axisPlacement": "auto",
            "thresholdsStyle": {
              "mode": "off"
            },
            "stacking": {
              "mode": "none",
              "group": "A"
            },
            "scaleDistribution": {
              "type": "log",
              "log": 10
            }
          },
          "decimals": 3,
          "min": 0.001,
          "max": 10,
          "thresholds": {
            "mode": "absolute",
            "steps": [
              {
                "color": "green",
                "value": null
              }
            ]
          }
        },
        "overrides": [
          {
            "matcher": {
              "id": "byFrameRefID",
              "options": "C"
            },
            "properties": [
              {
                "id": "color",
                "value": {
                  "mode": "fixed",
                  "fixedColor": "green"
                }
              },
              {
                "id": "custom.lineStyle",
                "value": {
                  "fill": "dash",
                  "dash": [
                    10,
                    10
                  ]
                }
              },
              {
                "id": "custom.lineWidth",
                "value": 1
              }
            ]
          },
          {
            "matcher": {
              "id": "byFrameRefID",
              "options": "D"
            },
            "properties": [
              {
                "id": "color",
                "value": {
                  "mode": "fixed",
                  "fixedColor": "red"
                }
              },
              {
                "id": "custom.lineStyle",
                "value": {
                  "fill": "dash",
                  "dash": [
                    10,
                    10
                  ]
                }
              },
              {
                "id": "custom.lineWidth",
                "value": 1
              }
            ]
          }
        ]
      },
      "options": {
        "legend": {
          "displayMode": "table",
          "placement": "bottom",
          "showLegend": true,
          "calcs": [
            "lastNotNull",
            "max"
          ]
        },
        "tooltip": {
          "mode": "multi",
          "sort": "desc"
        }
      }
    },
    {
      "id": 11,
      "type": "timeseries",
      "title": "Health score",
      "description": "gradwatch_health_score over time (1 = no vanishing or exploding parameter).",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 12,
        "y": 12,
        "w": 12,
        "h": 8
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_health_score{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "{{instance}}",
          "refId": "A",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "percentunit",
          "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": false,
            "axisPlacement": "auto",
            "thresholdsStyle": {
              "mode": "line"
            },
            "stacking": {
              "mode": "none",
              "group": "A"
            },
            "scaleDistribution": {
              "type": "linear"
            }
          },
          "min": 0,
          "max": 1,
          "thresholds": {
            "mode": "absolute",
            "steps": [
              {
                "color": "red",
                "value": null
              },
              {
                "color": "orange",
                "value": 0.5
              },
              {
                "color": "green",
                "value": 0.9
              }
            ]
          }
        },
        "overrides": []
      },
      "options": {
        "legend": {
          "displayMode": "table",
          "placement": "bottom",
          "showLegend": true,
          "calcs": [
            "lastNotNull",
            "max"
          ]
        },
        "tooltip": {
          "mode": "multi",
          "sort": "desc"
        }
      }
    },
    {
      "id": 12,
      "type": "timeseries",
      "title": "Vanishing, exploding and non-finite parameters",
      "description": "Parameters of each group below the vanishing threshold, above the exploding threshold (non-finite included) or holding NaN/Inf, at the last collected step.",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 0,
        "y": 20,
        "w": 12,
        "h": 8
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_vanishing_tensors{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "vanishing {{group}}",
          "refId": "A",
          "range": true,
          "instant": false
        },
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_exploding_tensors{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "exploding {{group}}",
          "refId": "B",
          "range": true,
          "instant": false
        },
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_nonfinite_tensors{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "non-finite {{group}}",
          "refId": "C",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "short",
          "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": false,
            "axisPlacement": "auto",
            "thresholdsStyle": {
              "mode": "off"
            },
            "stacking": {
              "mode": "none",
              "group": "A"
            },
            "scaleDistribution": {
              "type": "linear"
            }
          },
          "decimals": 0,
          "min": 0
        },
        "overrides": []
      },
      "options": {
        "legend": {
          "displayMode": "table",
          "placement": "bottom",
          "showLegend": true,
          "calcs": [
            "lastNotNull",
            "max"
          ]
        },
        "tooltip": {
          "mode": "multi",
          "sort": "desc"
        }
      }
    },
    {
      "id": 13,
      "type": "timeseries",
      "title": "Anomalous steps",
      "description": "Steps counted per interval: non-finite (pages), exploding, AMP-skipped (the GradScaler skipped them; no page), isolation violations.",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 12,
        "y": 20,
        "w": 12,
        "h": 8
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "increase(gradwatch_nonfinite_steps_total{job=~\"$job\",instance=~\"$instance\"}[$__rate_interval])",
          "legendFormat": "non-finite",
          "refId": "A",
          "range": true,
          "instant": false
        },
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "increase(gradwatch_exploding_steps_total{job=~\"$job\",instance=~\"$instance\"}[$__rate_interval])",
          "legendFormat": "exploding",
          "refId": "B",
          "range": true,
          "instant": false
        },
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "increase(gradwatch_amp_skipped_steps_total{job=~\"$job\",instance=~\"$instance\"}[$__rate_interval])",
          "legendFormat": "AMP skipped",
          "refId": "C",
          "range": true,
          "instant": false
        },
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "increase(gradwatch_isolation_violations_total{job=~\"$job\",instance=~\"$instance\"}[$__rate_interval])",
          "legendFormat": "isolation violated {{group}}",
          "refId": "D",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "short",
          "custom": {
            "drawStyle": "bars",
            "lineWidth": 1,
            "fillOpacity": 80,
            "showPoints": "never",
            "spanNulls": false,
            "axisPlacement": "auto",
            "thresholdsStyle": {
              "mode": "off"
            },
            "stacking": {
              "mode": "none",
              "group": "A"
            },
            "scaleDistribution": {
              "type": "linear"
            }
          },
          "decimals": 1,
          "min": 0
        },
        "overrides": []
      },
      "options": {
        "legend": {
          "displayMode": "table",
          "placement": "bottom",
          "showLegend": true,
          "calcs": [
            "lastNotNull",
            "max"
          ]
        },
        "tooltip": {
          "mode": "multi",
          "sort": "desc"
        }
      }
    },
    {
      "id": 14,
      "type": "state-timeline",
      "title": "Isolation",
      "description": "Groups configured as isolated (GRADWATCH_ISOLATED): violated when their gradient norm exceeds the isolation threshold.",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 0,
        "y": 28,
        "w": 12,
        "h": 6
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_isolation_violated{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "{{group}}",
          "refId": "A",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "bool_yes_no",
          "custom": {
            "fillOpacity": 80,
            "lineWidth": 0
          },
          "mappings": [
            {
              "type": "value",
              "options": {
                "0": {
                  "text": "isolated",
                  "color": "green"
                },
                "1": {
                  "text": "VIOLATED",
                  "color": "red"
                }
              }
            }
          ],
          "thresholds": {
            "mode": "absolute",
            "steps": [
              {
                "color": "green",
                "value": null
              },
              {
                "color": "red",
                "value": 1
              }
            ]
          }
        },
        "overrides": []
      },
      "options": {
        "showValue": "never",
        "mergeValues": true,
        "alignValue": "left",
        "rowHeight": 0.9,
        "legend": {
          "displayMode": "list",
          "placement": "bottom",
          "showLegend": true
        }
      }
    },
    {
      "id": 15,
      "type": "timeseries",
      "title": "Replica divergence",
      "description": "Relative spread (max - min) / max of the data-parallel replicas' global norms, measured every GRADWATCH_DIVERGENCE_EVERY collections. Above 1e-6 (red line) pages.",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 12,
        "y": 28,
        "w": 12,
        "h": 6
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_replica_divergence{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "{{instance}}",
          "refId": "A",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "sci",
          "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": false,
            "axisPlacement": "auto",
            "thresholdsStyle": {
              "mode": "line"
            },
            "stacking": {
              "mode": "none",
              "group": "A"
            },
            "scaleDistribution": {
              "type": "linear"
            }
          },
          "decimals": 1,
          "min": 0,
          "thresholds": {
            "mode": "absolute",
            "steps": [
              {
                "color": "green",
                "value": null
              },
              {
                "color": "red",
                "value": 1e-06
              }
            ]
          }
        },
        "overrides": []
      },
      "options": {
        "legend": {
          "displayMode": "table",
          "placement": "bottom",
          "showLegend": true,
          "calcs": [
            "lastNotNull",
            "max"
          ]
        },
        "tooltip": {
          "mode": "multi",
          "sort": "desc"
        }
      }
    },
    {
      "id": 16,
      "type": "timeseries",
      "title": "Step rate",
      "description": "Training steps and gradwatch collections per second (they differ when GRADWATCH_EVERY_N_STEPS > 1).",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 0,
        "y": 34,
        "w": 6,
        "h": 7
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "clamp_min(deriv(gradwatch_step{job=~\"$job\",instance=~\"$instance\"}[$__rate_interval]), 0)",
          "legendFormat": "steps/s",
          "refId": "A",
          "range": true,
          "instant": false
        },
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "rate(gradwatch_collections_total{job=~\"$job\",instance=~\"$instance\"}[$__rate_interval])",
          "legendFormat": "collections/s",
          "refId": "B",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "suffix:/s",
          "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": false,
            "axisPlacement": "auto",
            "thresholdsStyle": {
              "mode": "off"
            },
            "stacking": {
              "mode": "none",
              "group": "A"
            },
            "scaleDistribution": {
              "type": "linear"
            }
          },
          "min": 0
        },
        "overrides": []
      },
      "options": {
        "legend": {
          "displayMode": "table",
          "placement": "bottom",
          "showLegend": true,
          "calcs": [
            "lastNotNull",
            "max"
          ]
        },
        "tooltip": {
          "mode": "multi",
          "sort": "desc"
        }
      }
    },
    {
      "id": 17,
      "type": "timeseries",
      "title": "collect() time",
      "description": "Training-thread time spent in gradwatch's collect() (gradwatch_collect_seconds): median, 99th percentile and mean.",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 6,
        "y": 34,
        "w": 6,
        "h": 7
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "histogram_quantile(0.5, rate(gradwatch_collect_seconds_bucket{job=~\"$job\",instance=~\"$instance\"}[$__rate_interval]))",
          "legendFormat": "p50",
          "refId": "A",
          "range": true,
          "instant": false
        },
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "histogram_quantile(0.99, rate(gradwatch_collect_seconds_bucket{job=~\"$job\",instance=~\"$instance\"}[$__rate_interval]))",
          "legendFormat": "p99",
          "refId": "B",
          "range": true,
          "instant": false
        },
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "rate(gradwatch_collect_seconds_sum{job=~\"$job\",instance=~\"$instance\"}[$__rate_interval]) / rate(gradwatch_collect_seconds_count{job=~\"$job\",instance=~\"$instance\"}[$__rate_interval])",
          "legendFormat": "mean",
          "refId": "C",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "s",
          "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": false,
            "axisPlacement": "auto",
            "thresholdsStyle": {
              "mode": "off"
            },
            "stacking": {
              "mode": "none",
              "group": "A"
            },
            "scaleDistribution": {
              "type": "linear"
            }
          },
          "min": 0
        },
        "overrides": []
      },
      "options": {
        "legend": {
          "displayMode": "table",
          "placement": "bottom",
          "showLegend": true,
          "calcs": [
            "lastNotNull",
            "max"
          ]
        },
        "tooltip": {
          "mode": "multi",
          "sort": "desc"
        }
      }
    },
    {
      "id": 18,
      "type": "timeseries",
      "title": "gradwatch overhead",
      "description": "Fraction of the training thread's wall-clock time spent in collect(). Above 5% for 15 minutes alerts (GradwatchOverheadHigh).",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 12,
        "y": 34,
        "w": 6,
        "h": 7
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "rate(gradwatch_collect_seconds_sum{job=~\"$job\",instance=~\"$instance\"}[$__rate_interval])",
          "legendFormat": "{{instance}}",
          "refId": "A",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "percentunit",
          "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": false,
            "axisPlacement": "auto",
            "thresholdsStyle": {
              "mode": "line"
            },
            "stacking": {
              "mode": "none",
              "group": "A"
            },
            "scaleDistribution": {
              "type": "linear"
            }
          },
          "min": 0,
          "thresholds": {
            "mode": "absolute",
            "steps": [
              {
                "color": "green",
                "value": null
              },
              {
                "color": "red",
                "value": 0.05
              }
            ]
          }
        },
        "overrides": []
      },
      "options": {
        "legend": {
          "displayMode": "table",
          "placement": "bottom",
          "showLegend": true,
          "calcs": [
            "lastNotNull",
            "max"
          ]
        },
        "tooltip": {
          "mode": "multi",
          "sort": "desc"
        }
      }
    },
    {
      "id": 19,
      "type": "timeseries",
      "title": "Exporter and sink errors and drops",
      "description": "Snapshots gradwatch failed to publish and snapshots dropped because the exporter was still busy with an older one; per sink (history file, trackers), failed writes and steps the sink never received (GradwatchSinkFailing).",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 18,
        "y": 34,
        "w": 6,
        "h": 7
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "increase(gradwatch_publish_errors_total{job=~\"$job\",instance=~\"$instance\"}[$__rate_interval])",
          "legendFormat": "publish errors",
          "refId": "A",
          "range": true,
          "instant": false
        },
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "increase(gradwatch_dropped_snapshots_total{job=~\"$job\",instance=~\"$instance\"}[$__rate_interval])",
          "legendFormat": "dropped snapshots",
          "refId": "B",
          "range": true,
          "instant": false
        },
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "increase(gradwatch_sink_errors_total{job=~\"$job\",instance=~\"$instance\"}[$__rate_interval])",
          "legendFormat": "{{sink}} sink errors",
          "refId": "C",
          "range": true,
          "instant": false
        },
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "increase(gradwatch_sink_dropped_steps_total{job=~\"$job\",instance=~\"$instance\"}[$__rate_interval])",
          "legendFormat": "{{sink}} sink dropped steps",
          "refId": "D",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "short",
          "custom": {
            "drawStyle": "bars",
            "lineWidth": 1,
            "fillOpacity": 80,
            "showPoints": "never",
            "spanNulls": false,
            "axisPlacement": "auto",
            "thresholdsStyle": {
              "mode": "off"
            },
            "stacking": {
              "mode": "none",
              "group": "A"
            },
            "scaleDistribution": {
              "type": "linear"
            }
          },
          "min": 0,
          "decimals": 0
        },
        "overrides": []
      },
      "options": {
        "legend": {
          "displayMode": "table",
          "placement": "bottom",
          "showLegend": true,
          "calcs": [
            "lastNotNull",
            "max"
          ]
        },
        "tooltip": {
          "mode": "multi",
          "sort": "desc"
        }
      }
    },
    {
      "id": 20,
      "type": "timeseries",
      "title": "Time since last collect",
      "description": "Seconds since the collect() of the last published snapshot (time() - gradwatch_last_collect_timestamp_seconds). A rising line while the target is up means the training loop stalled; above 900 s for 5 minutes alerts (GradwatchMetricsStale).",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 0,
        "y": 41,
        "w": 12,
        "h": 8
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "time() - gradwatch_last_collect_timestamp_seconds{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "{{instance}}",
          "refId": "A",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "s",
          "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 0,
            "showPoints": "never",
            "spanNulls": false,
            "axisPlacement": "auto",
            "thresholdsStyle": {
              "mode": "line"
            },
            "stacking": {
              "mode": "none",
              "group": "A"
            },
            "scaleDistribution": {
              "type": "linear"
            }
          },
          "thresholds": {
            "mode": "absolute",
            "steps": [
              {
                "color": "green",
                "value": null
              },
              {
                "color": "red",
                "value": 900
              }
            ]
          },
          "min": 0
        },
        "overrides": []
      },
      "options": {
        "legend": {
          "displayMode": "table",
          "placement": "bottom",
          "showLegend": true,
          "calcs": [
            "lastNotNull",
            "max"
          ]
        },
        "tooltip": {
          "mode": "multi",
          "sort": "desc"
        }
      }
    },
    {
      "id": 21,
      "type": "timeseries",
      "title": "Clip coefficient",
      "description": "min(1, max_norm / (norm + 1e-6)) applied by GradWatch.clip_grad_norm_ at the last published step (gradwatch_clip_coef): 1 = not clipped, below 1 = the update was scaled down. Empty when the job does not clip through gradwatch.",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 12,
        "y": 41,
        "w": 12,
        "h": 8
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_clip_coef{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "{{instance}}",
          "refId": "A",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "short",
          "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 0,
            "showPoints": "never",
            "spanNulls": false,
            "axisPlacement": "auto",
            "thresholdsStyle": {
              "mode": "off"
            },
            "stacking": {
              "mode": "none",
              "group": "A"
            },
            "scaleDistribution": {
              "type": "linear"
            }
          },
          "thresholds": {
            "mode": "absolute",
            "steps": [
              {
                "color": "green",
                "value": null
              }
            ]
          },
          "min": 0,
          "max": 1
        },
        "overrides": []
      },
      "options": {
        "legend": {
          "displayMode": "table",
          "placement": "bottom",
          "showLegend": true,
          "calcs": [
            "lastNotNull",
            "max"
          ]
        },
        "tooltip": {
          "mode": "multi",
          "sort": "desc"
        }
      }
    },
    {
      "id": 22,
      "type": "timeseries",
      "title": "Spike score by group",
      "description": "How many robust deviations above its recent history (log-norm over the last spike_window steps) each group's norm was at the last published step; a step above the job's spike_threshold (default 6) counts as a spike.",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 0,
        "y": 49,
        "w": 12,
        "h": 8
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_grad_norm_spike_score{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "{{group}}",
          "refId": "A",
          "range": true,
          "instant": false
        },
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_global_grad_norm_spike_score{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "global",
          "refId": "B",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "short",
          "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 0,
            "showPoints": "never",
            "spanNulls": false,
            "axisPlacement": "auto",
            "thresholdsStyle": {
              "mode": "off"
            },
            "stacking": {
              "mode": "none",
              "group": "A"
            },
            "scaleDistribution": {
              "type": "linear"
            }
          },
          "thresholds": {
            "mode": "absolute",
            "steps": [
              {
                "color": "green",
                "value": null
              }
            ]
          }
        },
        "overrides": []
      },
      "options": {
        "legend": {
          "displayMode": "table",
          "placement": "bottom",
          "showLegend": true,
          "calcs": [
            "lastNotNull",
            "max"
          ]
        },
        "tooltip": {
          "mode": "multi",
          "sort": "desc"
        }
      }
    },
    {
      "id": 23,
      "type": "timeseries",
      "title": "Spikes by group",
      "description": "Steps detected as gradient-norm spikes per interval, from the counters (every collected step, also between scrapes). Any spike alerts (GradwatchGradNormSpike, warning).",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 12,
        "y": 49,
        "w": 12,
        "h": 8
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "increase(gradwatch_grad_norm_spikes_total{job=~\"$job\",instance=~\"$instance\"}[$__rate_interval])",
          "legendFormat": "{{group}}",
          "refId": "A",
          "range": true,
          "instant": false
        },
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "increase(gradwatch_global_grad_norm_spikes_total{job=~\"$job\",instance=~\"$instance\"}[$__rate_interval])",
          "legendFormat": "global",
          "refId": "B",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "short",
          "custom": {
            "drawStyle": "bars",
            "lineWidth": 1,
            "fillOpacity": 60,
            "showPoints": "never",
            "spanNulls": false,
            "axisPlacement": "auto",
            "thresholdsStyle": {
              "mode": "off"
            },
            "stacking": {
              "mode": "none",
              "group": "A"
            },
            "scaleDistribution": {
              "type": "linear"
            }
          },
          "thresholds": {
            "mode": "absolute",
            "steps": [
              {
                "color": "green",
                "value": null
              }
            ]
          },
          "min": 0
        },
        "overrides": []
      },
      "options": {
        "legend": {
          "displayMode": "table",
          "placement": "bottom",
          "showLegend": true,
          "calcs": [
            "lastNotNull",
            "max"
          ]
        },
        "tooltip": {
          "mode": "multi",
          "sort": "desc"
        }
      }
    },
    {
      "id": 24,
      "type": "timeseries",
      "title": "Per-step norm distribution",
      "description": "Quantiles of every collected step's norm in each interval, from the per-step histograms (log-spaced buckets): unlike the gauges, a one-step spike between two scrapes shows here. 'max' is the upper bound of the highest non-empty bucket.",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 0,
        "y": 57,
        "w": 12,
        "h": 8
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "histogram_quantile(0.5, sum by (job, instance, le) (rate(gradwatch_global_grad_norm_per_step_bucket{job=~\"$job\",instance=~\"$instance\"}[$__rate_interval])))",
          "legendFormat": "global p50",
          "refId": "A",
          "range": true,
          "instant": false
        },
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "histogram_quantile(0.99, sum by (job, instance, le) (rate(gradwatch_global_grad_norm_per_step_bucket{job=~\"$job\",instance=~\"$instance\"}[$__rate_interval])))",
          "legendFormat": "global p99",
          "refId": "B",
          "range": true,
          "instant": false
        },
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "histogram_quantile(1, sum by (job, instance, le) (rate(gradwatch_global_grad_norm_per_step_bucket{job=~\"$job\",instance=~\"$instance\"}[$__rate_interval])))",
          "legendFormat": "global max",
          "refId": "C",
          "range": true,
          "instant": false
        },
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "histogram_quantile(0.99, sum by (job, instance, group, le) (rate(gradwatch_grad_norm_per_step_bucket{job=~\"$job\",instance=~\"$instance\"}[$__rate_interval])))",
          "legendFormat": "{{group}} p99",
          "refId": "D",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "short",
          "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 0,
            "showPoints": "never",
            "spanNulls": false,
            "axisPlacement": "auto",
            "thresholdsStyle": {
              "mode": "off"
            },
            "stacking": {
              "mode": "none",
              "group": "A"
            },
            "scaleDistribution": {
              "type": "log",
              "log": 10
            }
          },
          "thresholds": {
            "mode": "absolute",
            "steps": [
              {
                "color": "green",
                "value": null
              }
            ]
          }
        },
        "overrides": []
      },
      "options": {
        "legend": {
          "displayMode": "table",
          "placement": "bottom",
          "showLegend": true,
          "calcs": [
            "lastNotNull",
            "max"
          ]
        },
        "tooltip": {
          "mode": "multi",
          "sort": "desc"
        }
      }
    },
    {
      "id": 25,
      "type": "timeseries",
      "title": "Top parameter norms",
      "description": "Gradient L2 norm of the parameters with the largest norms, plus every non-finite one (gradwatch_param_grad_norm). Empty unless the job sets param_metrics_top_k (GRADWATCH_PARAM_METRICS_TOP_K).",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 12,
        "y": 57,
        "w": 12,
        "h": 8
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_param_grad_norm{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "{{param}}",
          "refId": "A",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "short",
          "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 0,
            "showPoints": "never",
            "spanNulls": false,
            "axisPlacement": "auto",
            "thresholdsStyle": {
              "mode": "off"
            },
            "stacking": {
              "mode": "none",
              "group": "A"
            },
            "scaleDistribution": {
              "type": "log",
              "log": 10
            }
          },
          "thresholds": {
            "mode": "absolute",
            "steps": [
              {
                "color": "green",
                "value": null
              }
            ]
          }
        },
        "overrides": []
      },
      "options": {
        "legend": {
          "displayMode": "table",
          "placement": "bottom",
          "showLegend": true,
          "calcs": [
            "lastNotNull",
            "max"
          ]
        },
        "tooltip": {
          "mode": "multi",
          "sort": "desc"
        }
      }
    },
    {
      "id": 26,
      "type": "timeseries",
      "title": "Replica local gradient norms (before the all-reduce)",
      "description": "Min, median and max of the data-parallel replicas' local gradient norms, measured by gradwatch's DDP comm hook before the reduction (absent without it), and the outlier score max |x - median| / median (GradwatchReplicaOutlier warns above 1 for 15 minutes).",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 0,
        "y": 65,
        "w": 12,
        "h": 8
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_replica_grad_norm{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "{{instance}} {{stat}}",
          "refId": "A",
          "range": true,
          "instant": false
        },
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_replica_outlier_score{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "{{instance}} outlier score",
          "refId": "B",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "sci",
          "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": false,
            "axisPlacement": "auto",
            "thresholdsStyle": {
              "mode": "off"
            },
            "stacking": {
              "mode": "none",
              "group": "A"
            },
            "scaleDistribution": {
              "type": "log",
              "log": 10
            }
          },
          "thresholds": {
            "mode": "absolute",
            "steps": [
              {
                "color": "green",
                "value": null
              }
            ]
          }
        },
        "overrides": []
      },
      "options": {
        "legend": {
          "displayMode": "table",
          "placement": "bottom",
          "showLegend": true,
          "calcs": [
            "lastNotNull",
            "max"
          ]
        },
        "tooltip": {
          "mode": "multi",
          "sort": "desc"
        }
      }
    },
    {
      "id": 27,
      "type": "timeseries",
      "title": "Gradient noise scale B_simple",
      "description": "EMA-smoothed gradient noise scale (McCandlish et al. 2018), whole model and per group, in samples per the job's batch_size (per-replica batches when unset): the batch size beyond which more data parallelism stops helping. Needs the per-rank view (DDP).",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 12,
        "y": 65,
        "w": 12,
        "h": 8
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_gradient_noise_scale{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "{{instance}} whole model",
          "refId": "A",
          "range": true,
          "instant": false
        },
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_group_gradient_noise_scale{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "{{instance}} {{group}}",
          "refId": "B",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "short",
          "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": false,
            "axisPlacement": "auto",
            "thresholdsStyle": {
              "mode": "off"
            },
            "stacking": {
              "mode": "none",
              "group": "A"
            },
            "scaleDistribution": {
              "type": "log",
              "log": 10
            }
          },
          "thresholds": {
            "mode": "absolute",
            "steps": [
              {
                "color": "green",
                "value": null
              }
            ]
          }
        },
        "overrides": []
      },
      "options": {
        "legend": {
          "displayMode": "table",
          "placement": "bottom",
          "showLegend": true,
          "calcs": [
            "lastNotNull",
            "max"
          ]
        },
        "tooltip": {
          "mode": "multi",
          "sort": "desc"
        }
      }
    },
    {
      "id": 28,
      "type": "timeseries",
      "title": "Optimizer steps skipped",
      "description": "Optimizer steps skipped per interval, by reason: the guard's (watch.guard: nonfinite, spike; every guarded step, also between scrapes), amp_overflow (the GradScaler), deepspeed_overflow, no_update (weights unchanged although the gradients were finite and non-zero, update_stats); and the steps the guard skipped in a row. Repeated guard skips alert (GradwatchStepsSkipped, warning); a guard that reached max_consecutive_skips pages (GradwatchGuardStopped, critical); most steps skipped otherwise pages (GradwatchOptimizerNotUpdating, critical).",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 0,
        "y": 73,
        "w": 12,
        "h": 8
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "increase(gradwatch_skipped_steps_total{job=~\"$job\",instance=~\"$instance\"}[$__rate_interval])",
          "legendFormat": "{{reason}}",
          "refId": "A",
          "range": true,
          "instant": false
        },
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_consecutive_skipped_steps{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "skipped in a row",
          "refId": "B",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "short",
          "custom": {
            "drawStyle": "bars",
            "lineWidth": 1,
            "fillOpacity": 60,
            "showPoints": "never",
            "spanNulls": false,
            "axisPlacement": "auto",
            "thresholdsStyle": {
              "mode": "off"
            },
            "stacking": {
              "mode": "none",
              "group": "A"
            },
            "scaleDistribution": {
              "type": "linear"
            }
          },
          "thresholds": {
            "mode": "absolute",
            "steps": [
              {
                "color": "green",
                "value": null
              }
            ]
          },
          "min": 0
        },
        "overrides": []
      },
      "options": {
        "legend": {
          "displayMode": "table",
          "placement": "bottom",
          "showLegend": true,
          "calcs": [
            "lastNotNull",
            "max"
          ]
        },
        "tooltip": {
          "mode": "multi",
          "sort": "desc"
        }
      }
    },
    {
      "id": 29,
      "type": "timeseries",
      "title": "Weight and update norms by group",
      "description": "L2 norm of each group's weights and of the update the last optimizer step applied to them (update_stats). Recovered exactly from the optimizer's state, no copy of the weights; empty without update_stats. An update norm of 0 is a step that changed nothing (skipped).",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 12,
        "y": 73,
        "w": 12,
        "h": 8
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_weight_norm{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "{{instance}} {{group}} weights",
          "refId": "A",
          "range": true,
          "instant": false
        },
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_update_norm{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "{{instance}} {{group}} update",
          "refId": "B",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "short",
          "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": false,
            "axisPlacement": "auto",
            "thresholdsStyle": {
              "mode": "off"
            },
            "stacking": {
              "mode": "none",
              "group": "A"
            },
            "scaleDistribution": {
              "type": "log",
              "log": 10
            }
          },
          "thresholds": {
            "mode": "absolute",
            "steps": [
              {
                "color": "green",
                "value": null
              }
            ]
          }
        },
        "overrides": []
      },
      "options": {
        "legend": {
          "displayMode": "table",
          "placement": "bottom",
          "showLegend": true,
          "calcs": [
            "lastNotNull",
            "max"
          ]
        },
        "tooltip": {
          "mode": "multi",
          "sort": "desc"
        }
      }
    },
    {
      "id": 30,
      "type": "timeseries",
      "title": "Update-to-weight ratio by group",
      "description": "update_norm / weight_norm of each group per optimizer step (update_stats). Healthy Adam-type training sits around 1e-4 to 1e-3; above 0.01 or between 0 and 1e-6 for 15 minutes alerts (GradwatchUpdateRatioOutOfBand, warning). Update-norm spikes come before loss spikes.",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 0,
        "y": 81,
        "w": 12,
        "h": 8
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_update_ratio{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "{{instance}} {{group}}",
          "refId": "A",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "short",
          "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": false,
            "axisPlacement": "auto",
            "thresholdsStyle": {
              "mode": "off"
            },
            "stacking": {
              "mode": "none",
              "group": "A"
            },
            "scaleDistribution": {
              "type": "log",
              "log": 10
            }
          },
          "thresholds": {
            "mode": "absolute",
            "steps": [
              {
                "color": "green",
                "value": null
              }
            ]
          }
        },
        "overrides": []
      },
      "options": {
        "legend": {
          "displayMode": "table",
          "placement": "bottom",
          "showLegend": true,
          "calcs": [
            "lastNotNull",
            "max"
          ]
        },
        "tooltip": {
          "mode": "multi",
          "sort": "desc"
        }
      }
    },
    {
      "id": 31,
      "type": "timeseries",
      "title": "Stalled updates by group",
      "description": "Fraction of each group's intended updates the last optimizer step rounded away (under half an ulp of the weight: bf16/fp16 weights at small learning rates; float32 reads 0). Above 0.5 for 15 minutes alerts (GradwatchStalledUpdates, warning).",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 12,
        "y": 81,
        "w": 12,
        "h": 8
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_stalled_update_fraction{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "{{instance}} {{group}}",
          "refId": "A",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "percentunit",
          "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": false,
            "axisPlacement": "auto",
            "thresholdsStyle": {
              "mode": "off"
            },
            "stacking": {
              "mode": "none",
              "group": "A"
            },
            "scaleDistribution": {
              "type": "linear"
            }
          },
          "thresholds": {
            "mode": "absolute",
            "steps": [
              {
                "color": "green",
                "value": null
              }
            ]
          },
          "min": 0,
          "max": 1
        },
        "overrides": []
      },
      "options": {
        "legend": {
          "displayMode": "table",
          "placement": "bottom",
          "showLegend": true,
          "calcs": [
            "lastNotNull",
            "max"
          ]
        },
        "tooltip": {
          "mode": "multi",
          "sort": "desc"
        }
      }
    },
    {
      "id": 32,
      "type": "timeseries",
      "title": "Which rank is slow",
      "description": "With rank_timing: the straggler score (the fastest rank's working time over the slowest's; below 0.7 a straggler), the slowest rank (legend: its host) and the ranks' min, median and max working time per step (own compute up to the gradient collective, not waits on peers). GradwatchSameRankSlowest warns when the same rank stays the slowest with a low score. Empty without rank_timing.",
      "datasource": {
        "type": "prometheus",
        "uid": "${datasource}"
      },
      "gridPos": {
        "x": 0,
        "y": 89,
        "w": 12,
        "h": 8
      },
      "targets": [
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_straggler_score{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "{{instance}} straggler score",
          "refId": "A",
          "range": true,
          "instant": false
        },
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_slowest_rank{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "{{instance}} slowest rank ({{host}})",
          "refId": "B",
          "range": true,
          "instant": false
        },
        {
          "datasource": {
            "type": "prometheus",
            "uid": "${datasource}"
          },
          "expr": "gradwatch_rank_work_seconds{job=~\"$job\",instance=~\"$instance\"}",
          "legendFormat": "{{instance}} work seconds {{quantity}}",
          "refId": "C",
          "range": true,
          "instant": false
        }
      ],
      "fieldConfig": {
        "defaults": {
          "unit": "short",
          "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": false,
            "axisPlacement": "auto",
            "thresholdsStyle": {
              "mode": "off"
            },
            "stacking": {
              "mode": "none",
              "group": "A"
            }
          },
          "thresholds": {
            "mode": "absolute",
            "steps": [
              {
                "color": "green",
                "value": null
              }
            ]
          }
        },
        "overrides": []
      },
      "options": {
        "legend": {
          "displayMode": "table",
          "placement": "bottom",
          "showLegend": true,
          "calcs": [
            "lastNotNull",
            "max"
          ]
        },
        "tooltip": {
          "mode": "multi",
          "sort": "desc"
        }
      }
    }
  ]
}
