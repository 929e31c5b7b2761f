//! Every configuration key the docs name exists: each dotted key README mentions (text and
//! configuration table), each `COMPACTOR_<SECTION>__<KEY>` variable it or
//! `config/compactor.toml` spells out, and each key of `config/compactor.toml`, commented-out
//! examples included, is put through the real loader ([`compactor::Config::from_toml`]), whose
//! structs deny unknown fields. A key the loader does not know is an error of kind
//! `UnknownField`; any other answer (loaded, a value of the wrong type, a value that does
//! not validate) means the key exists. README's TOML examples and the shipped file must load
//! as they are.

use std::collections::BTreeSet;

use compactor::config::ConfigError;
use compactor::Config;
use figment::error::Kind;
use regex::Regex;

const README: &str = include_str!("../README.md");
const SHIPPED: &str = include_str!("../config/compactor.toml");

/// The top-level sections of the configuration, as the loader serialises its defaults.
fn sections() -> BTreeSet<String> {
    let defaults = toml::Table::try_from(Config::default()).expect("defaults serialise");
    let mut sections: BTreeSet<String> = defaults.keys().cloned().collect();
    // Empty by default, so absent from the serialised defaults.
    sections.extend(["routes".to_string(), "models".to_string()]);
    sections
}

/// A key as path segments (quotes of quoted segments removed).
type Key = Vec<String>;

fn key(dotted: &str) -> Key {
    let segment = Regex::new(r#""[^"]*"|[^.]+"#).expect("regex");
    segment
        .find_iter(dotted)
        .map(|m| m.as_str().trim_matches('"').to_string())
        .collect()
}

/// `COMPACTOR_STORE__REDIS_URL` → `store.redis_url`; placeholders (`<SECTION>`) are skipped.
fn env_keys(text: &str) -> Vec<Key> {
    let var = Regex::new(r"\bCOMPACTOR_([A-Za-z0-9_]+__[A-Za-z0-9_]+)").expect("regex");
    var.captures_iter(text)
        .map(|c| {
            c[1].split("__")
                .map(|s| s.to_ascii_lowercase())
                .collect::<Key>()
        })
        .collect()
}

/// Dotted keys under a real section, anywhere in `text`, except file names (`src/store.rs`)
/// and globs over several keys (`store.max_*`).
fn dotted_keys(text: &str, sections: &BTreeSet<String>) -> Vec<Key> {
    let dotted = Regex::new(r#"\b[a-z_]+(?:\.(?:[a-z_][a-z0-9_]*|"[^"`]*"|\*))+"#).expect("regex");
    dotted
        .find_iter(text)
        .filter(|m| {
            let before = text[..m.start()].chars().next_back();
            let after = text[m.end()..].chars().next();
            !matches!(before, Some('/' | '.' | '-' | '$')) && !matches!(after, Some('*' | '/'))
        })
        .map(|m| key(m.as_str().trim_end_matches(".*")))
        .filter(|k| k.len() >= 2 && sections.contains(&k[0]))
        .filter(|k| !matches!(k.last().map(String::as_str), Some("rs" | "md" | "toml")))
        .collect()
}

/// The first cell of each row of README's configuration table: `` `server.listen` ``,
/// `` `server.tls_cert`, `server.tls_key` `` and `` `[[routes]] prefix` ``.
fn table_keys() -> Vec<Key> {
    let start = README
        .find("| key | default | meaning |")
        .expect("README has a configuration table");
    let cell = Regex::new(r"`([^`]+)`").expect("regex");
    let mut keys = Vec::new();
    for row in README[start..].lines().skip(2) {
        let Some(first) = row.strip_prefix('|').and_then(|r| r.split('|').next()) else {
            break;
        };
        for c in cell.captures_iter(first) {
            let text = &c[1];
            match text.strip_prefix("[[routes]] ") {
                Some(leaf) => keys.push(vec!["routes".to_string(), leaf.to_string()]),
                None => keys.push(key(text)),
            }
        }
    }
    assert!(keys.len() > 50, "only {} rows read: {keys:?}", keys.len());
    keys
}

/// Every key `config/compactor.toml` sets or shows commented out (`# key = value` under a
/// section header, itself possibly commented out).
fn shipped_keys() -> Vec<Key> {
    let header = Regex::new(r"^#?\s*\[\[?([^\]]+)\]\]?\s*$").expect("regex");
    let assignment = Regex::new(r"^#?\s*([a-z_]+)\s*=\s").expect("regex");
    let mut section = Key::new();
    let mut keys = Vec::new();
    for line in SHIPPED.lines() {
        if let Some(h) = header.captures(line) {
            section = key(&h[1]);
        } else if let Some(a) = assignment.captures(line) {
            let mut k = section.clone();
            k.push(a[1].to_string());
            keys.push(k);
        }
    }
    assert!(keys.len() > 60, "only {} keys read", keys.len());
    keys
}

/// Whether the loader knows `key`: a TOML document setting it to a string is loaded, and the
/// answer is anything but an unknown field.
fn loader_knows(key: &Key) -> Result<(), String> {
    let (leaf, tables) = key.split_last().expect("non-empty key");
    let mut value = toml::Value::Table(toml::Table::from_iter([(
        leaf.clone(),
        toml::Value::String("x".into()),
    )]));
    for (i, table) in tables.iter().enumerate().rev() {
        if i == 0 && table == "routes" {
            value = toml::Value::Array(vec![value]);
        }
        value = toml::Value::Table(toml::Table::from_iter([(table.clone(), value)]));
    }
    let document = toml::to_string(&value).expect("serialise");
    match Config::from_toml(&document) {
        Err(ConfigError::Load(e)) => {
            let unknown: Vec<String> = e
                .clone()
                .into_iter()
                .filter(|e| matches!(e.kind, Kind::UnknownField(..)))
                .map(|e| e.to_string())
                .collect();
            if unknown.is_empty() {
                Ok(())
            } else {
                Err(format!("{}: {}", key.join("."), unknown.join("; ")))
            }
        }
        Ok(_) | Err(_) => Ok(()),
    }
}

fn check(what: &str, keys: impl IntoIterator<Item = Key>) {
    let keys: BTreeSet<Key> = keys.into_iter().collect();
    let unknown: Vec<String> = keys.iter().filter_map(|k| loader_knows(k).err()).collect();
    assert!(
        unknown.is_empty(),
        "{what} names keys the configuration does not have:\n{}",
        unknown.join("\n")
    );
}

#[test]
fn the_check_tells_known_keys_from_unknown_ones() {
    for known in [
        "server.listen",
        "summarizer.anthropic.api_key_env",
        "summarizer.exec.env.ANY_NAME",
        "models.\"gpt-x\".context_window",
    ] {
        assert_eq!(loader_knows(&key(known)), Ok(()), "{known}");
    }
    assert_eq!(
        loader_knows(&vec!["routes".into(), "strip_prefix".into()]),
        Ok(())
    );
    for unknown in [
        "summarizer.anthropic.api_key",
        "server.listen_port",
        "nonsense.key",
        "models.\"gpt-x\".window",
    ] {
        assert!(loader_knows(&key(unknown)).is_err(), "{unknown}");
    }
    assert!(loader_knows(&vec!["routes".into(), "strip".into()]).is_err());
    let found = dotted_keys(
        "set `summarizer.anthropic.api_key` or store.max_sessions; see src/store.rs, \
         `store.max_*` and `summarizer.exec.env.*`",
        &sections(),
    );
    assert_eq!(
        found,
        vec![
            key("summarizer.anthropic.api_key"),
            key("store.max_sessions"),
            key("summarizer.exec.env"),
        ]
    );
}

#[test]
fn every_key_readme_names_exists() {
    let sections = sections();
    check(
        "README",
        dotted_keys(README, &sections)
            .into_iter()
            .chain(env_keys(README))
            .chain(table_keys()),
    );
}

#[test]
fn every_key_the_shipped_file_names_exists() {
    check(
        "config/compactor.toml",
        shipped_keys().into_iter().chain(env_keys(SHIPPED)),
    );
    Config::from_toml(SHIPPED).expect("config/compactor.toml loads");
}

#[test]
fn readme_toml_examples_load() {
    let mut examples = 0;
    for block in README.split("```toml\n").skip(1) {
        let toml = block.split("```").next().expect("block");
        Config::from_toml(toml).unwrap_or_else(|e| panic!("README example: {e}\n{toml}"));
        examples += 1;
    }
    assert!(examples > 0, "README has no TOML example");
}
