//! The layering rule of docs/architecture.md (*Layers*), checked on the source: no module of
//! `src/` names a module of a higher layer (`crate::…`), and `dialect` and `compaction`, side
//! by side, never name each other. `src/testing.rs` is test support for every layer and is
//! exempt; so are `lib.rs` and `main.rs`, which name everything.

use std::path::{Path, PathBuf};

/// Each top-level module's layer, bottom-up, as the architecture document lists them.
const LAYERS: &[(&str, u8)] = &[
    ("config", 0),
    ("timing", 0),
    ("process", 0),
    ("budget", 0),
    ("transcript", 1),
    ("estimate", 1),
    ("cohort", 1),
    ("dialect", 2),
    ("compaction", 2),
    ("session", 3),
    ("metrics", 3),
    ("calibration", 3),
    ("event_log", 3),
    ("pipeline", 4),
    ("overflow", 4),
    ("usage", 4),
    ("cost", 4),
    ("summarizer", 4),
    ("proxy", 5),
    ("admin", 5),
    ("server", 5),
    ("app", 5),
    ("reload", 5),
    ("upstream", 5),
    ("error", 5),
    ("replay", 5),
    ("compact_once", 5),
    ("run", 5),
];

fn layer(module: &str) -> Option<u8> {
    LAYERS.iter().find(|(m, _)| *m == module).map(|(_, l)| *l)
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn no_module_names_one_above_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut checked = 0;
    let mut violations = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(&src).expect("under src");
        let top = rel
            .components()
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .map(|s| s.trim_end_matches(".rs"))
            .expect("a file name");
        if matches!(top, "lib" | "main" | "testing") {
            continue;
        }
        let own = layer(top).unwrap_or_else(|| {
            panic!("src/{top} has no layer: add it to docs/architecture.md and to LAYERS")
        });
        checked += 1;
        let text = std::fs::read_to_string(file).expect("read file");
        for (n, line) in text.lines().enumerate() {
            for (at, _) in line.match_indices("crate::") {
                let name: String = line[at + "crate::".len()..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                let Some(other) = layer(&name) else { continue };
                let sideways = own == 2 && other == 2 && name != top;
                if other > own || sideways {
                    violations.push(format!("{}:{}: {top} names {name}", rel.display(), n + 1));
                }
            }
        }
    }
    assert!(checked > 20, "only {checked} files checked");
    assert!(violations.is_empty(), "{}", violations.join("\n"));
}
