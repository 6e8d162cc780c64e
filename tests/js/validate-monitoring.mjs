// Validates Prometheus Operator objects (ServiceMonitor, PodMonitor, PrometheusRule) and
// cert-manager Certificates against the CRD schemas shipped in
// @kubernetes-models/prometheus-operator and @kubernetes-models/cert-manager, offline.
//
// Usage: node validate-monitoring.mjs FILE...
// Each FILE is YAML (one or more documents) or JSON (one object or an array of objects).
// Prints one line per problem and exits 1 if there was any; objects of other kinds are an
// error too, so a caller cannot silently validate nothing.
import { readFileSync } from "node:fs";
import { parseAllDocuments } from "yaml";
import {
  PodMonitor,
  PrometheusRule,
  ServiceMonitor,
} from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1";
import { Certificate } from "@kubernetes-models/cert-manager/cert-manager.io/v1";

const MODELS = {
  "monitoring.coreos.com/v1": { PodMonitor, PrometheusRule, ServiceMonitor },
  "cert-manager.io/v1": { Certificate },
};

function load(path) {
  const text = readFileSync(path, "utf8");
  if (path.endsWith(".json")) {
    const data = JSON.parse(text);
    return Array.isArray(data) ? data : [data];
  }
  return parseAllDocuments(text).map((doc) => {
    if (doc.errors.length) throw new Error(`${path}: ${doc.errors[0].message}`);
    return doc.toJS();
  }).filter((doc) => doc != null);
}

const files = process.argv.slice(2);
if (!files.length) {
  console.error("usage: node validate-monitoring.mjs FILE...");
  process.exit(2);
}
let checked = 0;
const problems = [];
for (const path of files) {
  for (const doc of load(path)) {
    const name = `${path}: ${doc.kind}/${doc.metadata?.name}`;
    const Model = (MODELS[doc.apiVersion] || {})[doc.kind];
    if (!Model) {
      problems.push(`${name}: not a ServiceMonitor, PodMonitor, PrometheusRule or Certificate`);
      continue;
    }
    try {
      new Model(doc).validate();
    } catch (err) {
      problems.push(`${name}: ${err.message}`);
    }
    checked += 1;
  }
}
for (const problem of problems) console.log(problem);
console.log(`checked ${checked} object(s), ${problems.length} problem(s)`);
process.exit(problems.length ? 1 : 0);
