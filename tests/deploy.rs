//! The deploy/ manifests agree with the code: every kvroute config they embed passes the same
//! validation `kvroute serve --check` does, and the dashboard only queries metrics that exist.
//! (Rendering and schema validation of the manifests run in `.ci/deploy-check`.)

use std::path::{Path, PathBuf};

use kvroute::config::Config;

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            yaml_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "yaml") {
            out.push(p);
        }
    }
}

#[test]
fn every_kvroute_config_in_a_configmap_is_valid() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy");
    let mut files = Vec::new();
    yaml_files(&root, &mut files);
    let mut checked = 0;
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        for doc in text.split("\n---\n") {
            let v: serde_json::Value = serde_saphyr::from_str(doc)
                .unwrap_or_else(|e| panic!("{}: not YAML: {e}", f.display()));
            if let Some(cfg) = v["data"]["kvroute.yaml"].as_str() {
                Config::from_yaml(cfg).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
                checked += 1;
            }
        }
    }
    assert!(checked >= 2, "base and the kubernetes-discovery overlay");
}

#[test]
fn the_dashboard_queries_only_metrics_kvroute_and_the_simulator_export() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dash: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("deploy/monitoring/grafana-dashboard.json")).unwrap(),
    )
    .unwrap();
    let sources = std::fs::read_to_string(root.join("src/metrics/mod.rs")).unwrap()
        + &std::fs::read_to_string(root.join("src/sim/metrics.rs")).unwrap();
    let mut names = 0;
    for panel in dash["panels"].as_array().unwrap() {
        for t in panel["targets"].as_array().unwrap() {
            let expr = t["expr"].as_str().unwrap();
            for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':')) {
                if word.starts_with("kvroute_") || word.starts_with("vllm:") {
                    let base = word.trim_end_matches("_bucket");
                    assert!(
                        sources.contains(&format!("\"{base}")),
                        "{base} is not a metric we export"
                    );
                    names += 1;
                }
            }
        }
    }
    assert!(names >= 10);
}
