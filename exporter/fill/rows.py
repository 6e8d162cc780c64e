"""A family being filled, as plain rows, and the plans that make one for this endpoint.

Plain rows rather than prometheus_client's families: the exposition is written from them
through templates (exporter.exposition_templates), and a Metric is made only for the
registry's own collect() (attach(), the multiprocess bridge).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

from exporter import catalog
from exporter.catalog import PROCESS_LABELS, Family


class Labels(dict[str, object]):
    """The labels of one subject (a reading, a GPU), given to many families: the tuple of
    values for a family's label names is made once per set of names, not once per family
    (most of a render's work before, at ~30 families per allocator reading)."""

    __slots__ = ("_values",)

    def __init__(self, *args: Mapping[str, object], **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._values: dict[tuple[tuple[str, ...], tuple[str, ...]], tuple[str, ...]] = {}

    def values_for(self, names: tuple[str, ...], const_values: tuple[str, ...]) -> tuple[str, ...]:
        key = (names, const_values)
        found = self._values.get(key)
        if found is None:
            found = self._values[key] = (*const_values, *(str(self.get(n, "")) for n in names))
        return found


class FamilyRows:
    """One family being filled, as plain rows: label values are given by name, so a label
    that is constant on this process (an embedded exporter with RANK set has `rank`
    everywhere) is left out in one place.

    A row's label values and its number are kept in two lists side by side, so that the
    renderer's two questions (its shape, its values) are answered without a pass over the
    rows: a render asks them of every family, once a second on cold caches."""

    __slots__ = ("const_values", "entry", "infos", "label_rows", "labels", "names", "numbers")

    def __init__(
        self,
        entry: Family,
        labels: tuple[str, ...],
        names: tuple[str, ...],
        const_values: tuple[str, ...],
    ):
        self.entry, self.labels, self.names, self.const_values = entry, labels, names, const_values
        self.label_rows: list[tuple[str, ...]] = []  # each row's label values
        self.numbers: list[float] = []  # each row's value (an info series' is 1)
        self.infos: list[Mapping[str, str]] = []  # each row's info labels (info families)

    def _values(self, labels: Mapping[str, object]) -> tuple[str, ...]:
        if type(labels) is Labels:
            return labels.values_for(self.names, self.const_values)
        return (*self.const_values, *(str(labels.get(n, "")) for n in self.names))

    def add(self, labels: Mapping[str, object], value: float) -> None:
        self.label_rows.append(self._values(labels))
        self.numbers.append(value)

    def add_info(self, labels: Mapping[str, object], info: Mapping[str, str]) -> None:
        self.label_rows.append(self._values(labels))
        self.numbers.append(1.0)
        self.infos.append(info)

    @property
    def rows(self) -> list[tuple[tuple[str, ...], float | Mapping[str, str]]]:
        """(label values, value) per row: a number, or the info labels of an info family."""
        if self.entry.kind == "info":
            return list(zip(self.label_rows, self.infos, strict=True))
        return list(zip(self.label_rows, self.numbers, strict=True))

    def shares_rows_of(self, other: FamilyRows) -> None:
        """Serve `other`'s rows as this family's too (a deprecated name beside its new one)."""
        self.label_rows, self.numbers, self.infos = other.label_rows, other.numbers, other.infos

    def shape(self) -> Hashable:
        """Everything the text depends on but the values: equal shapes, equal text between
        the values."""
        if self.infos:
            infos = tuple(tuple(info.items()) for info in self.infos)
            return (self.entry.name, self.labels, tuple(self.label_rows), infos)
        return (self.entry.name, self.labels, tuple(self.label_rows))

    def values(self) -> list[float]:
        """One per row, in the order of to_metric()'s samples (an info series' value is 1).
        The family's own list: a renderer reads it and keeps it, and changes nothing."""
        return self.numbers

    def to_metric(self) -> Metric:
        entry = self.entry
        metric: Metric
        if entry.kind == "gauge":
            metric = GaugeMetricFamily(entry.name, entry.help, labels=self.labels)
        elif entry.kind == "counter":
            metric = CounterMetricFamily(entry.name, entry.help, labels=self.labels)
        else:
            metric = InfoMetricFamily(entry.name, entry.help, labels=self.labels)
        for values, value in self.rows:
            metric.add_metric(values, value)  # type: ignore[arg-type]
        return metric


class LeftOut(FamilyRows):
    """A family this mode or detail level does not serve: what is added to it is dropped."""

    __slots__ = ()

    def add(self, labels: Mapping[str, object], value: float) -> None:
        pass

    def add_info(self, labels: Mapping[str, object], info: Mapping[str, str]) -> None:
        pass


# (family, served with or without samples): what each subject module hands up, in order.
Filled = list[tuple[FamilyRows, bool]]


def served(families: Iterable[tuple[FamilyRows, bool]]) -> list[FamilyRows]:
    """Those of the families served at this detail level (Plans decided): with samples, or
    always."""
    return [
        family
        for family, always in families
        if not isinstance(family, LeftOut) and (always or family.label_rows)
    ]


def with_deprecated_names(served: list[FamilyRows]) -> list[FamilyRows]:
    """Each family followed by its deprecated names (exporter.contract), with its samples:
    a dashboard of the old name keeps working for a minor release beside the new one."""
    if not catalog.DEPRECATED:  # every render, while no name is deprecated: nothing to add
        return served
    found = []
    for family in served:
        found.append(family)
        for old in catalog.DEPRECATED.get(family.entry.name, ()):
            alias = FamilyRows(old, family.labels, family.names, family.const_values)
            alias.shares_rows_of(family)
            found.append(alias)
    return found


_Plan = tuple[tuple[str, ...], tuple[str, ...], LeftOut | None]


class Plans:
    """New families of the catalog for one endpoint: each with its labels (and the process
    labels where one endpoint serves several processes), less those constant on this
    process, or the one shared LeftOut of a family not served here. Decided once per family
    and endpoint shape, not once per render."""

    def __init__(self, left_out: frozenset[str], const_labels: Mapping[str, str]) -> None:
        self._left_out = left_out
        self.const_names = tuple(const_labels)
        self.const_values = tuple(const_labels.values())
        # (family, per process) -> (label names, those not constant, its LeftOut or None)
        self._plans: dict[tuple[str, bool], _Plan] = {}
        # The same for a whole tuple of families at once (new_each), by (tuple, per process).
        self._each: dict[tuple[int, bool], list[tuple[Family, _Plan]]] = {}

    def new(self, entry: Family, per_process: bool = False) -> FamilyRows:
        found = self._plans.get((entry.name, per_process))
        if found is None:
            found = self._plan(entry, per_process)
        labels, names, left_out = found
        if left_out is not None:  # not served at this detail level: nothing to fill
            return left_out
        return FamilyRows(entry, labels, names, self.const_values)

    def new_each(self, entries: tuple[Family, ...], per_process: bool) -> list[FamilyRows]:
        """A new family for each of `entries`, in order, from plans looked up once for the
        whole tuple (the allocator's ~40 families each looked up alone were a fifth of its
        group's render). `entries` must be a tuple that lives as long as the process."""
        key = (id(entries), per_process)
        plans = self._each.get(key)
        if plans is None:
            plans = self._each[key] = [(e, self._plan(e, per_process)) for e in entries]
        const = self.const_values
        return [
            FamilyRows(entry, labels, names, const) if left_out is None else left_out
            for entry, (labels, names, left_out) in plans
        ]

    def _plan(self, entry: Family, per_process: bool) -> _Plan:
        names = entry.labels + (PROCESS_LABELS if per_process and entry.per_process else ())
        names = tuple(n for n in names if n not in self.const_names)
        labels = self.const_names + names
        # One for every render: what is added to it is dropped, so it stays empty.
        left_out = (
            LeftOut(entry, labels, names, self.const_values)
            if entry.name in self._left_out
            else None
        )
        self._plans[(entry.name, per_process)] = (labels, names, left_out)
        return labels, names, left_out
