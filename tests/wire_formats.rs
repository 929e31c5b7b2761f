//! docs/architecture.md's *Adding a wire format* checklist, walked for every format of
//! `DialectKind::ALL`: every file it names exists, and each format has its module, its
//! provider rules, its label in README's metrics table and its name on the command line.

use std::path::Path;
use std::process::Command;

use compactor::dialect::DialectKind;

fn read(path: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path))
        .unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The checklist section of docs/architecture.md.
fn checklist() -> String {
    let doc = read("docs/architecture.md");
    let start = doc
        .find("## Adding a wire format")
        .expect("docs/architecture.md has the checklist");
    let rest = &doc[start..];
    let end = rest[3..].find("\n## ").map_or(rest.len(), |i| i + 3);
    rest[..end].to_string()
}

/// The module file and the rules file of a format.
fn files(format: DialectKind) -> [&'static str; 2] {
    match format {
        DialectKind::ChatCompletions => {
            ["src/dialect/chat.rs", "plugins/testing/src/rules/chat.rs"]
        }
        DialectKind::Messages => [
            "src/dialect/messages.rs",
            "plugins/testing/src/rules/messages.rs",
        ],
        DialectKind::Responses => [
            "src/dialect/responses.rs",
            "plugins/testing/src/rules/responses.rs",
        ],
        DialectKind::Gemini => [
            "src/dialect/gemini.rs",
            "plugins/testing/src/rules/gemini.rs",
        ],
    }
}

#[test]
fn every_file_the_checklist_names_exists() {
    let checklist = checklist();
    let named: Vec<&str> = checklist
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|s| s.contains('/') && !s.contains('<') && !s.contains(' '))
        .collect();
    assert!(
        named.len() >= 10,
        "the checklist names the files: {named:?}"
    );
    for path in named {
        assert!(
            Path::new(env!("CARGO_MANIFEST_DIR")).join(path).exists(),
            "the checklist names {path}, which does not exist"
        );
    }
}

#[test]
fn every_format_has_what_the_checklist_asks() {
    let readme = read("README.md");
    let requests_row = readme
        .lines()
        .find(|l| l.starts_with("| `compactor_requests_total`"))
        .expect("README's metrics table lists compactor_requests_total");
    for format in DialectKind::ALL {
        for path in files(format) {
            let text = read(path);
            assert!(!text.is_empty(), "{path}");
        }
        // The module has the functions the checklist names.
        let module = read(files(format)[0]);
        for function in [
            "fn scan",
            "fn outputs",
            "fn looks_like",
            "fn ask_for_summary",
            "fn usage",
            "static REFUSAL",
        ] {
            assert!(module.contains(function), "{format:?}: {function}");
        }
        assert!(
            requests_row.contains(&format!("`{}`", format.label())),
            "README's metrics table names the route label {}",
            format.label()
        );
        // `compact --dialect` takes the format's name and reads a request of it (nothing
        // due: printed as received).
        let body = match format {
            DialectKind::ChatCompletions => {
                r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}"#
            }
            DialectKind::Messages => {
                r#"{"model":"claude-sonnet-4-5","max_tokens":10,"messages":[{"role":"user","content":"hi"}]}"#
            }
            DialectKind::Responses => r#"{"model":"gpt-5","input":"hi"}"#,
            DialectKind::Gemini => r#"{"contents":[{"role":"user","parts":[{"text":"hi"}]}]}"#,
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("request.json");
        std::fs::write(&file, body).expect("write");
        let out = Command::new(env!("CARGO_BIN_EXE_compactor"))
            .args(["compact", "--dialect", format.cli_name()])
            .arg(&file)
            .current_dir(dir.path())
            .output()
            .expect("compactor runs");
        assert!(out.status.success(), "{format:?}: {out:?}");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            body,
            "{format:?}"
        );
    }
    let out = Command::new(env!("CARGO_BIN_EXE_compactor"))
        .args(["compact", "--dialect", "gemini-ultra"])
        .output()
        .expect("compactor runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    for format in DialectKind::ALL {
        assert!(stderr.contains(format.cli_name()), "{stderr}");
    }
}
