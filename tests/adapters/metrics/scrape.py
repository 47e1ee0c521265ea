"""Scraping ``/metrics`` as Prometheus does, for the tests: a real HTTP GET, parsed by
``prometheus_client``'s own text parser."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
"""Every sample of a scrape: (name, sorted labels) -> value."""


def scrape(url: str) -> Samples:
    """GET ``url`` (status 200 required) and parse every sample."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample ``name`` with exactly ``labels`` (0 when the scrape has none)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)
