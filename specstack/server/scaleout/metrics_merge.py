"""Every replica's Prometheus text as one: each sample labelled with its ``replica``, and ``replica="total"``
summing them (counters, gauges, histogram buckets and sums alike: all add across replicas)."""

from __future__ import annotations

from collections import defaultdict

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

TOTAL = "total"


def merge(texts: dict[str, str]) -> bytes:
    """One exposition from ``texts`` (Prometheus text by replica id)."""
    families: dict[str, Metric] = {}
    totals: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
    for replica, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            if fam.name.endswith("_created"):  # creation times: neither summable nor needed
                continue
            out = families.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type, fam.unit))
            for s in fam.samples:
                if s.name.endswith("_created"):  # creation times: neither summable nor needed
                    continue
                out.add_sample(s.name, {**s.labels, "replica": replica}, s.value)
                totals[fam.name][(s.name, tuple(sorted(s.labels.items())))] += s.value
    for name, sums in totals.items():
        for (sample, labels), value in sums.items():
            families[name].add_sample(sample, {**dict(labels), "replica": TOTAL}, value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


class _Fixed:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)
