//! A/B arms in one deployment: a weighted split between two policies, sticky per client, with the
//! arm on every response and metric.

mod common;

use std::collections::{HashMap, HashSet};

use common::{metric, metrics_text, request_with, upstream};
use kvroute::config::{AbConfig, ArmConfig, Config, Overrides, PolicyConfig, PrefixParams};

fn ab_config(workers: Vec<kvroute::config::WorkerConfig>) -> Config {
    Config {
        workers,
        ab: Some(AbConfig {
            arms: vec![
                ArmConfig {
                    name: "control".into(),
                    weight: 1.0,
                    policy: PolicyConfig::RoundRobin,
                },
                ArmConfig {
                    name: "candidate".into(),
                    weight: 1.0,
                    policy: PolicyConfig::Prefix(PrefixParams::default()),
                },
            ],
            sticky_header: Some("x-session-id".into()),
        }),
        ..Config::default()
    }
}

#[tokio::test]
async fn sessions_stick_to_one_arm_both_arms_get_traffic_and_metrics_carry_the_arm() {
    let (a, b) = (upstream("w0", &[]).await, upstream("w1", &[]).await);
    let gw = common::gateway(ab_config(vec![a.worker_config(), b.worker_config()])).await;
    let mut arm_of: HashMap<String, String> = HashMap::new();
    for round in 0..3 {
        for s in 0..40 {
            let session = format!("user-{s}");
            let body = format!(r#"{{"prompt": "turn {round} of {session}", "max_tokens": 1}}"#);
            let r = request_with(
                gw.addr,
                "POST",
                "/v1/completions",
                &[("x-session-id", &session)],
                body.as_bytes(),
            )
            .await;
            assert_eq!(r.status, 200);
            let arm = r.header("x-kvroute-arm").unwrap().to_string();
            if let Some(prev) = arm_of.insert(session.clone(), arm.clone()) {
                assert_eq!(prev, arm, "{session} changed arm");
            }
        }
    }
    let arms: HashSet<&String> = arm_of.values().collect();
    assert_eq!(arms.len(), 2, "both arms used: {arms:?}");
    let control = arm_of.values().filter(|a| *a == "control").count();
    assert!(
        (8..=32).contains(&control),
        "{control} of 40 sessions in control"
    );

    let m = metrics_text(gw.addr).await;
    let count = |arm: &str, policy: &str| -> f64 {
        ["w0", "w1"]
            .iter()
            .filter_map(|w| metric(&m, &format!("kvroute_requests_total{{arm=\"{arm}\",policy=\"{policy}\",route=\"completions\",status=\"200\",worker=\"{w}\"}}")))
            .sum()
    };
    assert_eq!(count("control", "round_robin"), 3.0 * control as f64);
    assert_eq!(count("candidate", "prefix"), 3.0 * (40 - control) as f64);
    gw.shutdown.cancel();
}

#[tokio::test]
async fn without_the_header_a_prompt_prefix_stays_in_one_arm() {
    let (a, b) = (upstream("w0", &[]).await, upstream("w1", &[]).await);
    let gw = common::gateway(ab_config(vec![a.worker_config(), b.worker_config()])).await;
    let mut seen = HashSet::new();
    for p in 0..20 {
        let body = format!(r#"{{"prompt": "shared system prompt number {p}", "max_tokens": 1}}"#);
        let arms: HashSet<String> = futures_util::future::join_all((0..3).map(|_| async {
            let r = request_with(gw.addr, "POST", "/v1/completions", &[], body.as_bytes()).await;
            r.header("x-kvroute-arm").unwrap().to_string()
        }))
        .await
        .into_iter()
        .collect();
        assert_eq!(arms.len(), 1, "prompt {p} split across arms");
        seen.extend(arms);
    }
    assert_eq!(seen.len(), 2);
    gw.shutdown.cancel();
}

#[test]
fn one_policy_named_by_flag_or_env_ends_the_split() {
    let cfg = ab_config(vec![kvroute::config::WorkerConfig::from_url(
        "http://127.0.0.1:9",
    )]);
    assert!(cfg.validate().is_ok());
    let single = cfg
        .with_overrides(Overrides {
            policy: Some("least_conn".into()),
            ..Default::default()
        })
        .unwrap();
    assert!(single.ab.is_none());
    assert_eq!(single.policy.name(), "least_conn");
}

#[test]
fn bad_ab_sections_are_rejected() {
    let mut cfg = ab_config(vec![kvroute::config::WorkerConfig::from_url(
        "http://127.0.0.1:9",
    )]);
    cfg.ab.as_mut().unwrap().arms[1].name = "control".into();
    assert!(cfg.validate().unwrap_err().to_string().contains("unique"));
    let mut cfg = ab_config(vec![kvroute::config::WorkerConfig::from_url(
        "http://127.0.0.1:9",
    )]);
    cfg.ab.as_mut().unwrap().arms[0].weight = 0.0;
    assert!(cfg.validate().is_err());
    let mut cfg = ab_config(vec![kvroute::config::WorkerConfig::from_url(
        "http://127.0.0.1:9",
    )]);
    cfg.ab.as_mut().unwrap().arms.truncate(1);
    assert!(cfg.validate().is_err());
}

#[tokio::test]
async fn the_gateways_own_errors_name_the_arm_too() {
    // A worker that refuses connections: the answer is the gateway's 502, in the session's arm.
    let mut cfg = ab_config(vec![kvroute::config::WorkerConfig::from_url(
        "http://127.0.0.1:1",
    )]);
    cfg.health.interval_seconds = 0.0;
    let gw = common::gateway(cfg).await;
    let r = request_with(
        gw.addr,
        "POST",
        "/v1/completions",
        &[("x-session-id", "user-1")],
        br#"{"prompt": "x"}"#,
    )
    .await;
    assert!(matches!(r.status, 502 | 503), "{}", r.status);
    let arm = r.header("x-kvroute-arm").expect("arm header on an error");
    assert!(arm == "control" || arm == "candidate", "{arm}");
}

#[test]
fn check_reports_the_arms_of_an_ab_config() {
    let dir = common::TempDir::new("ab-check");
    let file = dir.join("ab.yaml");
    std::fs::write(
        &file,
        "workers: [{url: \"http://127.0.0.1:9\"}]\nab:\n  arms:\n    - {name: a, weight: 1, policy: {kind: round_robin}}\n    - {name: b, weight: 3, policy: {kind: cache_aware}}\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["serve", "--config", file.to_str().unwrap(), "--check"])
        .env_remove("KVROUTE_POLICY")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        stdout.contains("ab arms a=round_robin:1, b=cache_aware:3"),
        "{stdout}"
    );
}
