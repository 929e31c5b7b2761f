//! The `compactor check-config` command: layering (defaults < file < environment), unknown keys
//! and bad values rejected by name, secrets redacted in the printed configuration.

use std::path::Path;
use std::process::{Command, Output};

/// Runs `compactor <args>` in `dir` with only the given `COMPACTOR_*` variables set.
fn compactor(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_compactor"));
    command.args(args).current_dir(dir);
    for (key, _) in std::env::vars() {
        if key.starts_with("COMPACTOR_") {
            command.env_remove(key);
        }
    }
    for (k, v) in env {
        command.env(k, v);
    }
    command.output().expect("run compactor")
}

fn write_config(dir: &Path, text: &str) -> String {
    let path = dir.join("compactor.toml");
    std::fs::write(&path, text).expect("write config");
    path.display().to_string()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `check-config` output parsed back into TOML.
fn effective(o: &Output) -> toml::Value {
    assert!(o.status.success(), "check-config failed: {}", stderr(o));
    toml::from_str(&stdout(o))
        .unwrap_or_else(|e| panic!("output is not TOML ({e}):\n{}", stdout(o)))
}

#[test]
fn file_overrides_defaults_and_environment_overrides_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = write_config(
        dir.path(),
        "[upstream]\nbase_url = \"http://from-file.example:1234\"\nconnect_timeout_secs = 3.5\n",
    );

    let out = compactor(dir.path(), &["check-config", "--config", &path], &[]);
    let config = effective(&out);
    assert_eq!(
        config["upstream"]["base_url"].as_str(),
        Some("http://from-file.example:1234")
    );
    assert_eq!(
        config["upstream"]["connect_timeout_secs"].as_float(),
        Some(3.5)
    );
    // Untouched keys keep their defaults.
    assert_eq!(config["server"]["listen"].as_str(), Some("127.0.0.1:8787"));
    assert_eq!(config["compaction"]["max_messages"].as_integer(), Some(80));

    let out = compactor(
        dir.path(),
        &["check-config", "--config", &path],
        &[
            (
                "COMPACTOR_UPSTREAM__BASE_URL",
                "http://from-env.example:5678",
            ),
            ("COMPACTOR_SERVER__MAX_BODY_BYTES", "1234"),
        ],
    );
    let config = effective(&out);
    assert_eq!(
        config["upstream"]["base_url"].as_str(),
        Some("http://from-env.example:5678")
    );
    assert_eq!(config["server"]["max_body_bytes"].as_integer(), Some(1234));
    // The file still applies where the environment is silent.
    assert_eq!(
        config["upstream"]["connect_timeout_secs"].as_float(),
        Some(3.5)
    );
    assert!(!stdout(&out).contains("from-file.example"));
}

#[test]
fn without_a_file_defaults_and_environment_apply() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = compactor(
        dir.path(),
        &["check-config"],
        &[("COMPACTOR_UPSTREAM__BASE_URL", "http://only-env.example")],
    );
    let config = effective(&out);
    assert_eq!(
        config["upstream"]["base_url"].as_str(),
        Some("http://only-env.example")
    );
    // No file: everything else is the built-in default.
    assert_eq!(config["server"]["listen"].as_str(), Some("127.0.0.1:8787"));
    assert_eq!(config["compaction"]["max_messages"].as_integer(), Some(80));
}

#[test]
fn unknown_keys_are_rejected_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = write_config(
        dir.path(),
        "[upstream]\nbase_url = \"http://x.example\"\nrespone_timeout_secs = 5\n",
    );
    let out = compactor(dir.path(), &["check-config", "--config", &path], &[]);
    assert!(!out.status.success(), "typo accepted: {}", stdout(&out));
    assert!(
        stderr(&out).contains("respone_timeout_secs"),
        "stderr does not name the key: {}",
        stderr(&out)
    );

    let path = write_config(dir.path(), "[servr]\nlisten = \"127.0.0.1:1\"\n");
    let out = compactor(dir.path(), &["check-config", "--config", &path], &[]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("servr"), "{}", stderr(&out));

    // Through the environment too.
    let out = compactor(
        dir.path(),
        &["check-config"],
        &[("COMPACTOR_SERVER__LISTEN_PORT", "1")],
    );
    assert!(!out.status.success(), "env typo accepted: {}", stdout(&out));
    assert!(stderr(&out).contains("listen_port"), "{}", stderr(&out));
}

#[test]
fn invalid_values_and_missing_files_fail_with_the_key_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = write_config(dir.path(), "[upstream]\nbase_url = \"ftp://x.example\"\n");
    let out = compactor(dir.path(), &["check-config", "--config", &path], &[]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("upstream.base_url"),
        "{}",
        stderr(&out)
    );

    let out = compactor(
        dir.path(),
        &["check-config"],
        &[("COMPACTOR_UPSTREAM__RESPONSE_TIMEOUT_SECS", "-1")],
    );
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("response_timeout_secs"),
        "{}",
        stderr(&out)
    );

    let missing = dir.path().join("nope.toml").display().to_string();
    let out = compactor(dir.path(), &["check-config", "--config", &missing], &[]);
    assert!(!out.status.success(), "a named config file must exist");
}

#[test]
fn check_config_redacts_the_admin_token() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = write_config(
        dir.path(),
        "[upstream]\nbase_url = \"http://x.example\"\n\n[admin]\ntoken = \"s3cret-admin-token\"\n",
    );
    let out = compactor(dir.path(), &["check-config", "--config", &path], &[]);
    let config = effective(&out);
    assert!(
        !stdout(&out).contains("s3cret-admin-token"),
        "{}",
        stdout(&out)
    );
    assert!(!stderr(&out).contains("s3cret-admin-token"));
    assert_eq!(config["admin"]["token"].as_str(), Some("[redacted]"));

    let out = compactor(
        dir.path(),
        &["check-config", "--config", &path],
        &[("COMPACTOR_ADMIN__TOKEN", "env-secret-token")],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stdout(&out).contains("env-secret-token"));
    assert!(!stdout(&out).contains("s3cret-admin-token"));
    assert!(stdout(&out).contains("[redacted]"));
}

#[test]
fn a_badly_typed_secret_is_named_but_never_printed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = write_config(dir.path(), "[admin]\ntoken = 918273645\n");
    let out = compactor(dir.path(), &["check-config", "--config", &path], &[]);
    assert!(
        !out.status.success(),
        "a numeric token in TOML is a type error"
    );
    assert!(stderr(&out).contains("admin.token"), "{}", stderr(&out));
    assert!(!stderr(&out).contains("918273645"), "{}", stderr(&out));
    assert!(!stdout(&out).contains("918273645"));
}

#[test]
fn compactor_variables_that_are_not_section_keys_are_ignored_with_a_warning() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A wrapper script's own variables: not configuration, and no reason to refuse to start.
    let out = compactor(
        dir.path(),
        &["check-config"],
        &[
            ("COMPACTOR_BIN", "/usr/local/bin/compactor"),
            ("COMPACTOR_HOME", "/srv/compactor"),
            ("COMPACTOR_SERVER__MAX_BODY_BYTES", "4321"),
        ],
    );
    let config = effective(&out);
    assert_eq!(
        config["server"]["max_body_bytes"].as_integer(),
        Some(4321),
        "section keys are still read"
    );
    let err = stderr(&out);
    assert!(err.contains("ignoring COMPACTOR_BIN"), "{err}");
    assert!(err.contains("ignoring COMPACTOR_HOME"), "{err}");
    assert!(!err.contains("MAX_BODY_BYTES"), "{err}");

    // An unknown key inside a known section is still an error.
    let out = compactor(
        dir.path(),
        &["check-config"],
        &[("COMPACTOR_BIN", "x"), ("COMPACTOR_SERVER__NOPE", "1")],
    );
    assert!(!out.status.success(), "{}", stdout(&out));
    assert!(stderr(&out).contains("nope"), "{}", stderr(&out));
}

/// Every `[compaction]` key is documented with its default in README's configuration table
/// and in `config/compactor.toml`.
#[test]
fn every_compaction_key_is_documented() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = compactor(dir.path(), &["check-config"], &[]);
    let config = effective(&out);
    let readme = include_str!("../README.md");
    let shipped = include_str!("../config/compactor.toml");
    let keys = config["compaction"].as_table().expect("[compaction]");
    assert!(keys.contains_key("strategy"), "{keys:?}");
    for (key, value) in keys {
        let row = format!("| `compaction.{key}` |");
        let line = readme
            .lines()
            .find(|l| l.starts_with(&row))
            .unwrap_or_else(|| panic!("README has no row for compaction.{key}"));
        let default = match value {
            // An empty string reads as `""` in a table.
            toml::Value::String(s) if s.is_empty() => "\"\"".to_string(),
            toml::Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        assert!(
            line.contains(&format!("`{default}`")),
            "README's row for compaction.{key} does not give its default {default}: {line}"
        );
        assert!(
            shipped.lines().any(|l| l.starts_with(&format!("{key} = "))),
            "config/compactor.toml does not set {key}"
        );
    }
}

#[test]
fn check_config_prints_each_routes_own_compaction_settings() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = write_config(
        dir.path(),
        "[compaction]\nstrategy = \"hybrid\"\nmax_messages = 60\n\
         [[routes]]\nprefix = \"/batch\"\nbase_url = \"http://batch.example:1\"\n\
         [routes.compaction]\nenabled = false\n\
         [[routes]]\nprefix = \"/anthropic\"\nbase_url = \"http://a.example:2\"\n\
         [[routes]]\nprefix = \"/watch\"\nbase_url = \"http://w.example:3\"\n\
         compaction = { mode = \"shadow\", strategy = \"summarize\", sample_ratio = 0.25 }\n",
    );
    let out = compactor(dir.path(), &["check-config", "--config", &path], &[]);
    // Still TOML as a whole, the routes' own settings as they were written.
    let config = effective(&out);
    assert_eq!(
        config["routes"][0]["compaction"]["enabled"].as_bool(),
        Some(false)
    );
    let text = stdout(&out);
    let block = |prefix: &str| -> String {
        let start = text
            .find(&format!("({prefix}): its requests are compacted with"))
            .unwrap_or_else(|| panic!("no effective settings for {prefix}:\n{text}"));
        let rest = &text[start..];
        let end = rest[1..].find("\n# routes[").map_or(rest.len(), |e| e + 1);
        rest[..end]
            .lines()
            .skip(1)
            .map(|l| l.trim_start_matches("# "))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let watch: toml::Value = toml::from_str(&block("/watch")).expect("effective TOML");
    let watch = &watch["compaction"];
    assert_eq!(watch["mode"].as_str(), Some("shadow"));
    assert_eq!(watch["strategy"].as_str(), Some("summarize"));
    assert_eq!(watch["sample_ratio"].as_float(), Some(0.25));
    assert_eq!(watch["max_messages"].as_integer(), Some(60), "inherited");
    let batch: toml::Value = toml::from_str(&block("/batch")).expect("effective TOML");
    assert_eq!(batch["compaction"]["enabled"].as_bool(), Some(false));
    assert!(
        !text.contains("(/anthropic): its requests"),
        "no settings of its own"
    );

    // A route's value is checked as the section it makes, and named by its route.
    let bad = write_config(
        dir.path(),
        "[[routes]]\nprefix = \"/x\"\nbase_url = \"http://x.example:1\"\n\
         compaction = { trigger_ratio = 1.5 }\n",
    );
    let out = compactor(dir.path(), &["check-config", "--config", &bad], &[]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("routes[0].compaction.trigger_ratio"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_listen_address_in_use_is_named() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = write_config(
        dir.path(),
        &format!("[server]\nlisten = \"{addr}\"\nadmin_listen = \"127.0.0.1:0\"\n"),
    );
    let out = compactor(dir.path(), &["serve", "--config", &path], &[]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains(&format!("cannot listen on {addr}")),
        "{}",
        stderr(&out)
    );
}
