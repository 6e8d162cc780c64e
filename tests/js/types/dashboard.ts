/**
 * The Grafana dashboard JSON model this project writes, checked against @grafana/schema.
 *
 * @grafana/schema types the dashboard, panels, variables and each core panel plugin's options
 * and field config; it leaves two things datasource-specific: query targets and annotation
 * queries. For those this file declares the fields Grafana's Prometheus datasource reads.
 * Panels are a union over the plugin types the dashboards use, discriminated by `type`, so a
 * panel's options are checked against its own plugin's schema. Add a plugin here before using
 * it in a dashboard. Two more things the v1 schema lacks are declared here: the import
 * sections `__inputs` and `__requires` (written by Grafana's "Export for sharing externally",
 * read by its import), and panel links, which v1 types as dashboard links although Grafana
 * reads {title, url, targetBlank} (the v2 schema's DataLink).
 */
import type * as schema from "@grafana/schema";
import type * as timeseries from "@grafana/schema/dist/esm/raw/composable/timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen.js";
import type * as stat from "@grafana/schema/dist/esm/raw/composable/stat/panelcfg/x/StatPanelCfg_types.gen.js";
import type * as table from "@grafana/schema/dist/esm/raw/composable/table/panelcfg/x/TablePanelCfg_types.gen.js";
import type * as bargauge from "@grafana/schema/dist/esm/raw/composable/bargauge/panelcfg/x/BarGaugePanelCfg_types.gen.js";
import type { DataLink } from "@grafana/schema/dist/esm/schema/dashboard/v2alpha0/types.gen.js";
import type { Json } from "./json.js";

/** A Prometheus query target (Grafana's PromQuery, the fields this project uses). */
export interface PromQuery extends schema.DataQuery {
  expr: string;
  legendFormat?: string;
  range?: boolean;
  instant?: boolean;
  format?: "time_series" | "table" | "heatmap";
  interval?: string;
  intervalFactor?: number;
  editorMode?: "code" | "builder";
  exemplar?: boolean;
}

/** A Prometheus annotation query: target plus the fields that format the events. */
export interface PromAnnotation extends Omit<schema.AnnotationQuery, "target"> {
  target?: { expr: string; interval?: string; refId: string };
  titleFormat?: string;
  textFormat?: string;
  tagKeys?: string;
  useValueForTime?: boolean;
}

/** An import input: Grafana's import asks for a data source and writes it over ${name}. */
export interface DatasourceInput {
  name: string;
  label: string;
  description: string;
  type: "datasource";
  pluginId: string;
  pluginName: string;
}

/** What the dashboard needs; Grafana's import lists it. */
export interface Requirement {
  type: "grafana" | "datasource" | "panel";
  id: string;
  name: string;
  version: string;
}

interface FieldConfigSourceOf<Custom> {
  defaults: Omit<schema.FieldConfig, "custom"> & { custom?: Custom };
  overrides: Array<{
    matcher: schema.MatcherConfig;
    properties: Array<{ id: string; value?: unknown }>;
  }>;
}

type PanelOf<Type extends string, Options, Custom> = Omit<
  schema.Panel,
  "type" | "options" | "fieldConfig" | "targets" | "links"
> & {
  type: Type;
  links?: DataLink[];
  options: Options;
  fieldConfig: FieldConfigSourceOf<Custom>;
  targets: PromQuery[];
};

export type TimeSeriesPanel = PanelOf<"timeseries", timeseries.Options, timeseries.FieldConfig>;
export type StatPanel = PanelOf<"stat", stat.Options, never>;
export type TablePanel = PanelOf<"table", table.Options, table.FieldConfig>;
export type BarGaugePanel = PanelOf<"bargauge", bargauge.Options, never>;
export type RowPanel = Omit<schema.RowPanel, "panels"> & {
  panels: Array<TimeSeriesPanel | StatPanel | TablePanel | BarGaugePanel>;
};

export type DashboardPanel = TimeSeriesPanel | StatPanel | TablePanel | BarGaugePanel | RowPanel;

export type StrictDashboard = Json<
  Omit<schema.Dashboard, "panels" | "annotations" | "templating"> & {
    __inputs: DatasourceInput[];
    __requires: Requirement[];
    panels: DashboardPanel[];
    annotations: { list: PromAnnotation[] };
    templating: { list: schema.VariableModel[] };
  }
>;
