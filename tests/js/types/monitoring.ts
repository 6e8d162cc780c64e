/**
 * Prometheus Operator objects as JSON, from @kubernetes-models/prometheus-operator's types.
 * The models' validate() checks values against the CRD schemas but lets unknown keys through
 * (the CRDs allow them); assigning a rendered object to these types catches misspelt keys.
 */
import type { IPodMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor";
import type { IPrometheusRule } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule";
import type { IServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor";
import type { ICertificate } from "@kubernetes-models/cert-manager/cert-manager.io/v1/Certificate";
import type { Json } from "./json.js";

export type StrictPodMonitor = Json<IPodMonitor>;
export type StrictPrometheusRule = Json<IPrometheusRule>;
export type StrictServiceMonitor = Json<IServiceMonitor>;
export type StrictCertificate = Json<ICertificate>;
