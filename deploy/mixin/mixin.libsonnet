// The gradwatch monitoring mixin: Prometheus recording and alerting rules and the Grafana
// dashboard, configured by `_config` (config.libsonnet). The shipped files are its output
// with the defaults (`make deploy-assets`, scripts/gen_mixin.py):
//   deploy/prometheus/gradwatch-rules.yml     prometheusRules.groups + prometheusAlerts.groups
//   deploy/grafana/gradwatch-dashboard.json   grafanaDashboards['gradwatch-dashboard.json']
// Use it like any mixin:
//   (import 'gradwatch-mixin/mixin.libsonnet') + { _config+:: { selector: 'cluster="eu-1"' } }
(import 'config.libsonnet')
+ (import 'rules.libsonnet')
+ (import 'alerts.libsonnet')
+ (import 'dashboards.libsonnet')
