"""/metrics text written from templates is prometheus_client's own text, byte for byte: for
every family the catalog declares, in every mode, at both detail levels, in every format and
escaping a scraper can ask for, on the first render and on later ones whose values moved."""

from __future__ import annotations

import copy
import gzip
import math
from collections.abc import Iterable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar
from prometheus_client.utils import floatToGoString

from exporter.exposition import ExpositionCache
from exporter.exposition_templates import TemplateRenderer, families_of, format_value
from tests.helpers import catalog_collector, every_family_cases

# What Prometheus 2 and 3 send, and every format and escaping client_python can answer.
ACCEPTS = [
    "",
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "application/openmetrics-text;version=1.0.0;escaping=underscores;q=0.6,"
    "text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
    "application/openmetrics-text",
    "application/openmetrics-text; version=0.0.1",
    *(
        f"{kind};version={version};escaping={escaping}"
        for kind, version in (
            ("text/plain", "1.0.0"),
            ("application/openmetrics-text", "1.0.0"),
            ("application/openmetrics-text", "2.0.0"),
        )
        for escaping in ("allow-utf-8", "underscores", "dots", "values")
    ),
]


class Frozen(Collector):
    """A collector's families read once: client_python's process metrics read /proc on each
    collect, and two renders must see the same values to be compared."""

    def __init__(self, collector: Collector) -> None:
        self.metrics = list(collector.collect())

    def collect(self) -> Iterable[Metric]:
        return self.metrics


def _registry(*collectors: Collector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    return registry


def _client_python() -> list[Collector]:
    return [Frozen(ProcessCollector(registry=None)), Frozen(PlatformCollector(registry=None))]


@pytest.mark.slow
@pytest.mark.parametrize("detail", ["basic", "full"])
def test_every_family_in_every_format_is_prometheus_clients_own_text(detail: str) -> None:
    own = _client_python()
    cases = every_family_cases()
    assert len(cases) > 10
    for mode, per_process, const, sample in cases:
        collector = catalog_collector(sample, mode, const, per_process, detail)
        registry = _registry(*own, collector)
        cache = ExpositionCache([*own, collector], lambda: None)
        for accept in ACCEPTS:
            encoder, content_type = choose_encoder(accept)
            body = cache.body(accept, "")
            assert body.content_type == content_type
            assert body.data == encoder(registry), (mode, detail, accept)
            zipped = cache.body(accept, "gzip")
            assert zipped.gzipped and gzip.decompress(zipped.data) == body.data


@pytest.mark.slow
def test_a_template_made_once_gives_the_encoders_text_as_the_values_move() -> None:
    """Later renders reuse the templates of the first: values that moved (and a series that
    came) must still come out as the encoder writes them."""
    cases = [case for case in every_family_cases() if case[0] == "demo"]
    renderers = {accept: TemplateRenderer(choose_encoder(accept)[0]) for accept in ACCEPTS}
    moved = 0
    for mode, per_process, const, sample in cases:
        for factor in (1.0, 3.0, 0.0, -1.5, float("inf"), float("nan")):
            changed = copy.deepcopy(sample)
            for reading in changed.allocators:
                scaled: dict[str, Any] = {k: v * factor for k, v in reading.gauges.items()}
                reading.gauges = scaled
            collector = catalog_collector(changed, mode, const, per_process)
            for accept, renderer in renderers.items():
                expected = choose_encoder(accept)[0](_registry(collector))
                assert renderer.render(families_of([collector])) == expected, (accept, factor)
            moved += 1
    assert moved > 10


@pytest.mark.slow
def test_every_family_of_the_catalog_has_a_template() -> None:
    """A template that does not give back the encoder's text is dropped for the encoder's
    slower path, silently: every family the exporter serves must keep one, in each format."""
    for mode, per_process, const, sample in every_family_cases():
        collector = catalog_collector(sample, mode, const, per_process, "full")
        for accept in ACCEPTS:
            renderer = TemplateRenderer(choose_encoder(accept)[0])
            renderer.render(families_of([collector]))
            fell_back = [shape for shape, kept in renderer._templates.items() if kept is None]
            assert renderer._templates and not fell_back, (mode, accept, fell_back[:1])


def test_a_family_the_template_cannot_carry_is_rendered_by_the_encoder() -> None:
    """A timestamp or an exemplar follows the value: no template, the encoder's text."""
    stamped = GaugeMetricFamily("stamped", "with a timestamp", labels=["a"])
    stamped.add_metric(["x"], 1.5, timestamp=12.5)
    exemplar = Metric("latency_seconds", "with an exemplar", "histogram")
    exemplar.add_sample("latency_seconds_bucket", {"le": "+Inf"}, 3, None, Exemplar({"t": "1"}, 2))
    exemplar.add_sample("latency_seconds_count", {}, 3)
    exemplar.add_sample("latency_seconds_sum", {}, 4.5)
    collector = Frozen(_registry())
    collector.metrics = [stamped, exemplar]
    for accept in ACCEPTS:
        encoder = choose_encoder(accept)[0]
        renderer = TemplateRenderer(encoder)
        for _ in range(2):
            assert renderer.render(families_of([collector])) == encoder(_registry(collector))


def test_templates_of_shapes_gone_are_dropped() -> None:
    """Processes come and go: only the shapes of the last render are kept."""
    renderer = TemplateRenderer(choose_encoder("")[0])
    for pid in range(50):
        family = GaugeMetricFamily("per_pid", "one series per process", labels=["pid"])
        family.add_metric([str(pid)], pid)
        collector = Frozen(_registry())
        collector.metrics = [family]
        renderer.render(families_of([collector]))
    assert len(renderer._templates) == 1


def test_a_template_filled_again_gives_each_renders_own_values_bit_for_bit() -> None:
    """A template keeps the text of the values it was last filled with: the same values again
    (most families from one tick to the next) give that text, any other values their own,
    down to the zero's sign; and a family without series keeps its HELP and TYPE lines."""
    renderer = TemplateRenderer(choose_encoder("")[0])
    for values in ([0.0, 1.0], [0.0, 1.0], [-0.0, 1.0], [-0.0, 1.0], [0.0, 1.0], [math.nan, 1.0],
                   [math.nan, 1.0], [1.0, 0.0], [1.0, 0.0], []):  # fmt: skip
        family = GaugeMetricFamily("moving", "two series", labels=["n"])
        empty = GaugeMetricFamily("empty", "no series")
        for n, value in enumerate(values):
            family.add_metric([str(n)], value)
        collector = Frozen(_registry())
        collector.metrics = [family, empty]
        expected = choose_encoder("")[0](_registry(collector))
        assert renderer.render(families_of([collector])) == expected, values


@pytest.mark.parametrize(
    "value",
    [0, 0.0, -0.0, False, True, 1, -1, 1.5, 2**63, 1e300, 5e-324, math.inf, -math.inf, math.nan],
)
def test_a_value_is_written_as_client_python_writes_it(value) -> None:
    """Twice: once formatted, once remembered."""
    assert format_value(value) == floatToGoString(value)
    assert format_value(value) == floatToGoString(value)
