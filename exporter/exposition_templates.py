"""Exposition text from templates: prometheus_client writes the text between the values once,
and each render formats only the values.

From one tick to the next a family keeps its name, help, labels and series; only the values
move. So a family's text is rendered by prometheus_client's own encoder once per *shape* (the
family with its label sets, values aside), with each sample's value standing in as its index;
the text around those placeholders is kept, and a render joins it with the values formatted as
the encoder formats them (`floatToGoString`). The bytes are the encoder's, for every format and
escaping it is asked for (text 0.0.4, text 1.0.0, OpenMetrics 1.0.0 and later, each escaping
scheme), because the encoder wrote everything but the numbers, and a template is kept only if
it reproduces the encoder's text exactly. A family the template cannot carry (a sample with a
timestamp or an exemplar) is rendered by the encoder each time.

The cost of a render is then the values' formatting plus a dictionary lookup per family,
instead of prometheus_client's per-sample label escaping and string building (5-10x more);
a family whose values are those of the last render, bit for bit, takes that render's text.
"""

from __future__ import annotations

import copy
import math
from array import array
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Protocol

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

Encoder = Callable[[Collector], bytes]


class Family(Protocol):
    """What a template is made from and filled with (exporter.fill.rows.FamilyRows is one)."""

    def shape(self) -> Hashable | None:
        """The family's text apart from its values; None if it has no template."""
        ...

    def values(self) -> list[float]: ...

    def to_metric(self) -> Metric: ...


class ForeignFamily:
    """A family that another collector made (client_python's process metrics)."""

    __slots__ = ("metric",)

    def __init__(self, metric: Metric) -> None:
        self.metric = metric

    def shape(self) -> Hashable | None:
        m = self.metric
        if any(s.timestamp is not None or s.exemplar or s.native_histogram for s in m.samples):
            return None  # they follow the value on its line: no template
        samples = tuple((s.name, tuple(s.labels.items())) for s in m.samples)
        return (m.name, m.type, m.documentation, m.unit, samples)

    def values(self) -> list[float]:
        return [s.value for s in self.metric.samples]

    def to_metric(self) -> Metric:
        return self.metric


class _One(Collector):
    def __init__(self, metrics: Sequence[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return self.metrics


# Values formatted before: most values of a tick are the last tick's (totals, peaks,
# counters at rest), and floatToGoString costs ~1 us where a lookup costs ~50 ns. Bounded:
# emptied when full, so a gauge that never repeats cannot grow it.
_FORMATTED: dict[float, str] = {}
_FORMATTED_MAX = 4096


def format_value(value: float) -> str:
    """floatToGoString(value), remembered. Zero apart: 0.0 and -0.0 are one key but two texts
    (and counters at rest are most of a render's zeros)."""
    if not value:
        return "-0.0" if math.copysign(1.0, value) < 0 else "0.0"
    found = _FORMATTED.get(value)
    if found is None:
        if len(_FORMATTED) >= _FORMATTED_MAX:
            _FORMATTED.clear()
        found = _FORMATTED[value] = floatToGoString(value)
    return found


class Template:
    """A family's text as (text before a value, that value's index) pieces and a tail."""

    __slots__ = ("_last", "_one", "pieces", "tail")

    def __init__(self, pieces: list[tuple[str, int]], tail: str) -> None:
        self.pieces, self.tail = pieces, tail
        # Most families have one series: their text is two strings around the value.
        self._one = len(pieces) == 1 and pieces[0][1] == 0
        # The last values filled in (their bytes: exact, -0.0 and NaN included) and the text;
        # none yet (a family without series has the empty bytes).
        self._last: tuple[bytes | None, str] = (None, "")

    def fill(self, values: Sequence[float]) -> str:
        if self._one:
            return self.pieces[0][0] + format_value(values[0]) + self.tail
        text = [before + format_value(values[index]) for before, index in self.pieces]
        text.append(self.tail)
        return "".join(text)

    def fill_again(self, values: Sequence[float]) -> str:
        """fill(values), the last text again where the values are the last ones, bit for bit:
        from one tick to the next most families' values do not move (build and settings
        info, sources up, counters at rest), and a render asks each family every second."""
        key = array("d", values).tobytes()
        last = self._last
        if last[0] == key:
            return last[1]
        text = self.fill(values)
        self._last = (key, text)  # one object: a render on another thread reads it whole
        return text


def _parse(text: str, samples: int) -> Template | None:
    """The template of a family rendered with each sample's index as its value; None if the
    text is not lines of `... value` and comments (a timestamp or exemplar follows a value)."""
    pieces: list[tuple[str, int]] = []
    before = ""
    for line in text.split("\n")[:-1]:
        if line.startswith("#"):
            before += line + "\n"
            continue
        prefix, _, placeholder = line.rpartition(" ")
        try:
            index = int(float(placeholder))
        except ValueError:
            return None
        if not 0 <= index < samples:
            return None
        pieces.append((before + prefix + " ", index))
        before = "\n"
    return Template(pieces, before)


_UNKNOWN = Template([], "")  # a shape without a template yet (None: one without any)


class TemplateRenderer:
    """Renders families through templates made by `encoder`; one renderer per format."""

    def __init__(self, encoder: Encoder) -> None:
        self._encoder = encoder
        # What the encoder writes after the last family ("# EOF\n" for OpenMetrics).
        self._trailer = encoder(_One([])).decode("utf-8")
        self._templates: dict[Hashable, Template | None] = {}

    def render(self, families: Iterable[Family]) -> bytes:
        # Only the shapes of this render are kept: processes that come and go must not grow
        # the map, and the next tick usually has the same shapes.
        templates = self._templates
        kept: dict[Hashable, Template | None] = {}
        text = []
        for family in families:
            shape = family.shape()
            if shape is None:
                template = None
            else:  # a shape is hashed twice a render: its tuples keep no hash
                template = templates.get(shape, _UNKNOWN)
                if template is _UNKNOWN:
                    template = self._template(family)
                kept[shape] = template
            if template is None:
                text.append(self._encode(family.to_metric()))
            else:
                text.append(template.fill_again(family.values()))
        self._templates = kept
        text.append(self._trailer)
        return "".join(text).encode("utf-8")

    def _encode(self, metric: Metric) -> str:
        """The encoder's text of one family, without its trailer."""
        text = self._encoder(_One([metric])).decode("utf-8")
        return text[: len(text) - len(self._trailer)]

    def _template(self, family: Family) -> Template | None:
        metric = family.to_metric()
        stand_in = copy.copy(metric)
        stand_in.samples = [s._replace(value=float(i)) for i, s in enumerate(metric.samples)]
        text = self._encode(stand_in)
        template = _parse(text, len(metric.samples))
        # Kept only if it gives back the encoder's own text: then it is exact for any values.
        indices = [float(i) for i in range(len(metric.samples))]
        if template is None or template.fill(indices) != text:
            return None
        return template


def families_of(collectors: Iterable[Collector]) -> list[Family]:
    """The families of `collectors`, in order: rows where the collector has them
    (`families()`), else what its collect() yields."""
    found: list[Family] = []
    for collector in collectors:
        rows = getattr(collector, "families", None)
        if rows is not None:
            found += rows()
        else:
            found += [ForeignFamily(metric) for metric in collector.collect()]
    return found
