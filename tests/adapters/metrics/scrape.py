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


def value(samples: Samples, name: str, default: float | None = None, **labels: str) -> float:
    """The sample ``name`` with exactly ``labels``; ``default`` when the scrape has none
    (without one, a missing sample fails: a test of a value must see it exported).

    Raises:
        KeyError: no such sample and no ``default``.
    """
    sample = (name, tuple(sorted(labels.items())))
    if default is None:
        return samples[sample]
    return samples.get(sample, default)
