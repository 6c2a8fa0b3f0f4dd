//! The `kvroute` binary's command line: config checking and overrides.

use std::process::Command;

fn kvroute(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(args)
        .env_remove("KVROUTE_POLICY")
        .output()
        .unwrap()
}

#[test]
fn every_example_config_passes_check() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut checked = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let out = kvroute(&["serve", "--config", path.to_str().unwrap(), "--check"]);
        assert!(
            out.status.success(),
            "{}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let policy = path.file_stem().unwrap().to_str().unwrap();
        assert!(
            String::from_utf8_lossy(&out.stdout).contains(&format!("policy {policy}")),
            "{} is not the {policy} policy",
            path.display()
        );
        checked += 1;
    }
    assert!(checked >= 3);
}

#[test]
fn a_bad_config_fails_check_with_a_clear_message() {
    let dir = std::env::temp_dir().join(format!("kvroute-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.yaml");
    std::fs::write(
        &bad,
        "workers: [{url: 'http://a:1'}]\npolicy: {kind: prefix, load_factr: 2}\n",
    )
    .unwrap();
    let out = kvroute(&["serve", "--config", bad.to_str().unwrap(), "--check"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("load_factr"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn flags_and_env_override_the_policy() {
    let out = kvroute(&[
        "serve",
        "--worker",
        "http://127.0.0.1:9",
        "--policy",
        "least_conn",
        "--check",
    ]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("policy least_conn"));
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args([
            "serve",
            "--config",
            concat!(env!("CARGO_MANIFEST_DIR"), "/config/prefix.yaml"),
            "--check",
        ])
        .env("KVROUTE_POLICY", "round_robin")
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("policy round_robin"),
        "{out:?}"
    );
    let out = kvroute(&[
        "serve",
        "--worker",
        "http://127.0.0.1:9",
        "--policy",
        "fastest",
        "--check",
    ]);
    assert!(!out.status.success());
}

#[test]
fn every_example_config_checks_and_names_its_policy() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/config");
    let mut seen = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let policy = path.file_stem().unwrap().to_string_lossy().into_owned();
        let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["serve", "--config", path.to_str().unwrap(), "--check"])
            .env_remove("KVROUTE_POLICY")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{path:?}: {out:?}");
        assert!(
            stdout.contains(&format!("policy {policy}")),
            "{path:?}: {stdout}"
        );
        seen += 1;
    }
    assert!(seen >= 4);
}
