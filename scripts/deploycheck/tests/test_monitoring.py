"""monitoring.py: Prometheus scrapes every gateway; the dashboard queries the gateway's metrics."""

import unittest

from deploycheck import monitoring
from deploycheck.monitoring import DASHBOARD, DATASOURCES, PROMETHEUS, PROVIDERS
from deploycheck.tests.support import TreeCase

LATENCY = (
    "histogram_quantile(0.99, sum by (le) (rate(presence_delivery_latency_seconds_bucket[1m])))"
)
# A panel per metric the dashboard must show: (id, title, expression).
PANELS = [
    (1, "Sessions", "sum by (instance) (presence_sessions)"),
    (2, "Up", 'up{job="presence"}'),
    (3, "Transitions", "rate(presence_transitions_total[1m])"),
    (4, "Frames", "rate(presence_frames_sent_total[1m])"),
    (5, "Delivery", LATENCY),
    (6, "Redis", LATENCY.replace("delivery", "redis")),
    (7, "Errors", "rate(presence_errors_total[1m])"),
]
METRICS = {
    "presence_sessions", "presence_transitions_total", "presence_frames_sent_total", "presence_errors_total",
    "presence_delivery_latency_seconds_bucket", "presence_redis_latency_seconds_bucket",
}


def prometheus(interval="5s", targets=("gateway-1:8080", "gateway-2:8080", "gateway-3:8080")):
    return {
        "global": {"scrape_interval": "15s"},
        "scrape_configs": [
            {"job_name": "presence", "scrape_interval": interval, "static_configs": [{"targets": list(targets)}]},
            {"job_name": "self", "static_configs": [{"targets": ["localhost:9090"]}]},
        ],
    }


def dashboard(panels=PANELS):
    # The first panel sits in a row, as Grafana nests them.
    made = [
        {"id": i, "title": t, "type": "timeseries", "gridPos": {"x": 0, "y": i}, "targets": [{"expr": e}]}
        for i, t, e in panels
    ]
    return {
        "title": "Presence gateway",
        "uid": "presence",
        "schemaVersion": 39,
        "templating": {"list": [{"type": "datasource", "query": "prometheus"}]},
        "panels": [{"id": 100, "type": "row", "panels": made[:1]}, *made[1:]],
    }


class MonitoringTests(TreeCase):
    def check(self, changes=None):
        files = {
            PROMETHEUS: prometheus(),
            DASHBOARD: dashboard(),
            DATASOURCES: {"datasources": [{"type": "prometheus", "url": "http://prometheus:9090"}]},
            PROVIDERS: {"providers": [{"options": {"path": "/dashboards"}}]},
        }
        tree = self.tree({**files, **(changes or {})}, metrics=METRICS)
        found = tree.document("docker-compose.yml")
        monitoring.check_prometheus(tree, found)
        monitoring.check_grafana(tree, found)
        return tree

    def test_good_monitoring_passes(self):
        tree = self.check()
        self.assertClean(tree)
        self.assertIn("ok    deploy/grafana/dashboard.json: 7 panels", tree.report.lines)
        self.assertEqual([c[:3] for c in self.linted], [["promtool", "check", "config"], ["promtool", "check", "rules"]])

    def test_gateway_not_scraped_fails(self):
        tree = self.check({PROMETHEUS: prometheus(targets=("gateway-1:8080", "gateway-2:8080", "gateway-3:9100"))})
        self.assertFails(tree, "deploy/prometheus.yml: does not scrape gateway-3:8080")

    def test_slow_scrape_fails(self):
        tree = self.check({PROMETHEUS: prometheus(interval=None)})
        self.assertFails(tree, "the gateways' scrape_interval must be 5s (found ['15s'])")

    def test_panel_on_a_metric_the_gateway_lacks_fails(self):
        panels = PANELS[:6] + [(7, "Errors", "rate(presence_failures_total[1m])")]
        tree = self.check({DASHBOARD: dashboard(panels)})
        self.assertFails(tree, "panel 'Errors': 'rate(presence_failures_total[1m])': unknown metric presence_failures_total",
                         "no panel shows presence_errors_total")

    def test_quantile_not_over_buckets_by_le_fails(self):
        panels = PANELS[:4] + [(5, "Delivery", LATENCY.replace("by (le)", "by (instance)"))] + PANELS[5:]
        tree = self.check({DASHBOARD: dashboard(panels)})
        self.assertFails(tree, "panel 'Delivery'", "histogram_quantile needs rate(..._bucket[...]) summed by (le, ...)")

    def test_duplicate_panel_ids_fail(self):
        tree = self.check({DASHBOARD: dashboard(PANELS[:6] + [(1, "Errors", PANELS[6][2])])})
        self.assertFails(tree, "panel ids must be present and unique")

    def test_dashboard_outside_the_provisioned_folder_fails(self):
        tree = self.check({PROVIDERS: {"providers": [{"options": {"path": "/other"}}]}})
        self.assertFails(tree, "provider path ['/other'] does not hold the dashboard compose mounts")


if __name__ == "__main__":
    unittest.main()
