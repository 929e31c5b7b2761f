//! File tracking: which files the conversation read and modified (docs/architecture.md,
//! *File tracking*).
//!
//! The tracker reads the model's tool calls. Tool names are matched case-insensitively after
//! dropping namespaces (`mcp__fs__read_file` → `read_file`, `functions.bash` → `bash`):
//! - read tools (`read`, `Read`, `read_file`, `view`, ...) → read, from `file_path`/`path`/
//!   `file`/`filename`; search tools (Claude Code's `Grep`, `search`) → read when their `path`
//!   names a file rather than a directory (`Glob` only lists names and is not tracked);
//! - write tools (`write`, `Write`, `edit`, `Edit`, `MultiEdit`, `patch`, `apply_patch`,
//!   `create`, `edit_file`, ...) → modified; patch bodies (`*** Update File: x`, `+++ b/x`)
//!   name their files;
//! - editor tools (`str_replace_editor`, `str_replace_based_edit_tool`): `command: view` →
//!   read, `create`/`str_replace`/`insert`/`undo_edit` → modified;
//! - shell tools (`shell`, `bash`, Codex's `shell`/`local_shell` with an argv array such as
//!   `["bash", "-lc", "cat x"]`, ...) → both, from the `command`: it is split into
//!   simple commands (quotes, `&&`, `||`, `;`, pipes, heredocs), then `cat`/`head`/`tail`/
//!   `less`/`grep`/... operands and `<` sources are read; `sed -i`, `tee`, `touch`, `rm`, the
//!   destination of `mv`/`cp`, and `>`/`>>` targets are modified;
//! - SWE-agent: `open` → read and `create` → modified, each making that file the current one;
//!   `edit` without a path modifies the current file. SWE-agent's text mode (commands in a
//!   fenced block of the assistant's text: `open x`, `create x`, `edit 1:5` … `end_of_edit`)
//!   is tracked the same way.
//!
//! Lists start from the lists of the previous compaction, so they accumulate over a session,
//! and are bounded: each holds the `compaction.max_tracked_files` most recently touched files,
//! most recent first (a file seen again moves to the front; the least recent falls off), so a
//! session that reads thousands of files does not carry them all in every summary.

use std::sync::LazyLock;

use regex::Regex;
use serde_json::Value;

use super::shell::{split_commands, Redirect, SimpleCommand};
use crate::transcript::{Message, Part, Role};

/// Argument keys that name the file a tool works on.
const PATH_KEYS: &[&str] = &[
    "file_path",
    "path",
    "file",
    "filename",
    "filepath",
    "target_file",
    "notebook_path",
    "absolute_path",
];

/// Argument keys holding several files.
const PATHS_KEYS: &[&str] = &["paths", "file_paths", "files"];

/// Every regular expression of the crate, compiled together in [`Patterns::compile`], the
/// one place that a unit test (`every_pattern_compiles`) forces: a pattern that does not
/// compile fails `cargo test` rather than silently switching tracking off in production. At
/// run time they stay fail-open: should compiling fail anyway, [`PATTERNS`] is `None`, it is
/// logged once, and the tracker goes on without what the patterns find (no panic on a request
/// path). A test (`regexes_are_compiled_only_in_patterns`) keeps `Regex::new` out of the rest
/// of `src/`.
struct Patterns {
    /// `*** Update File: x` / `*** Add File: x` / `*** Delete File: x` / `*** Move to: x` (the
    /// `apply_patch` format).
    patch_file: Regex,
    /// `+++ b/x` lines of a unified diff.
    diff_file: Regex,
    /// A fenced code block in assistant text, fences at the start of their lines (inline
    /// "```perl…```" runs inside a paragraph are not blocks).
    fenced: Regex,
    /// SWE-agent's `open <path> [line]` / `create <path>`.
    swe_open_create: Regex,
    /// SWE-agent's `edit <start>:<end>`.
    swe_edit: Regex,
    /// An environment assignment prefix (`FOO=bar cmd`).
    env_assignment: Regex,
}

impl Patterns {
    fn compile() -> Result<Patterns, regex::Error> {
        Ok(Patterns {
            patch_file: Regex::new(
                r"(?m)^\*\*\* (?:(?:Update|Add|Delete) File|Move to): *(\S.*?)\s*$",
            )?,
            diff_file: Regex::new(r"(?m)^\+\+\+ (?:[ab]/)?(\S+)")?,
            fenced: Regex::new(r"(?ms)^[ \t]*```[^\n`]*\n(.*?)^[ \t]*```")?,
            swe_open_create: Regex::new(
                r#"^(open|create)\s+(?:"([^"]+)"|'([^']+)'|(\S+))(?:\s+\d+)?\s*$"#,
            )?,
            swe_edit: Regex::new(r"^edit\s+\d+(?::\d+)?\s*$")?,
            env_assignment: Regex::new(r"^[A-Za-z_][A-Za-z0-9_]*=")?,
        })
    }
}

/// [`Patterns`], compiled on first use; `None` only if one failed to compile.
static PATTERNS: LazyLock<Option<Patterns>> = LazyLock::new(|| {
    Patterns::compile()
        .map_err(|e| tracing::error!(error = %e, "file-tracking patterns do not compile"))
        .ok()
});

/// The compiled pattern `pick` selects, if the patterns compiled.
fn pattern(pick: fn(&Patterns) -> &Regex) -> Option<&'static Regex> {
    PATTERNS.as_ref().map(pick)
}

fn is_match(pick: fn(&Patterns) -> &Regex, text: &str) -> bool {
    pattern(pick).is_some_and(|r| r.is_match(text))
}

/// What a tool does to files, by its (normalised) name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ToolKind {
    Read,
    Modify,
    Patch,
    Editor,
    Shell,
    SweOpen,
    SweCreate,
    SweEdit,
    SweSearch,
    Search,
}

fn classify(name: &str) -> Option<ToolKind> {
    let lower = name.trim().to_ascii_lowercase();
    let short = lower.rsplit("__").next().unwrap_or(&lower);
    let short = short.rsplit('.').next().unwrap_or(short);
    let short = short.replace('-', "_");
    use ToolKind::*;
    Some(match short.as_str() {
        "read" | "read_file" | "readfile" | "view" | "view_file" | "open_file" | "cat"
        | "read_many_files" | "get_file_contents" => Read,
        "open" => SweOpen,
        "create" => SweCreate,
        "edit" => SweEdit,
        "search_file" => SweSearch,
        "grep" | "search" | "search_files" => Search,
        "write" | "write_file" | "writefile" | "write_to_file" | "create_file" | "edit_file"
        | "multiedit" | "multi_edit" | "str_replace" | "insert" | "replace" | "replace_in_file"
        | "search_replace" | "notebookedit" | "notebook_edit" | "delete_file" | "append_file" => {
            Modify
        }
        "patch" | "apply_patch" | "applypatch" | "apply_diff" => Patch,
        "str_replace_editor" | "str_replace_based_edit_tool" | "text_editor" | "editor" => Editor,
        "shell" | "bash" | "sh" | "zsh" | "run_shell_command" | "execute_command"
        | "exec_command" | "run_command" | "terminal" | "run_terminal_cmd" | "local_shell"
        | "exec" | "execute_bash" | "container_exec" | "shell_command" => Shell,
        _ => return None,
    })
}

pub use crate::config::DEFAULT_MAX_TRACKED_FILES;

/// Accumulates the files read and modified.
#[derive(Debug, Clone)]
pub struct FileTracker {
    /// Most recent first, at most `limit`.
    read: Vec<String>,
    /// Most recent first, at most `limit`.
    modified: Vec<String>,
    limit: usize,
    /// SWE-agent's open file, which `edit` applies to.
    current: Option<String>,
}

impl Default for FileTracker {
    fn default() -> Self {
        FileTracker::with_limit(DEFAULT_MAX_TRACKED_FILES)
    }
}

impl FileTracker {
    /// An empty tracker keeping [`DEFAULT_MAX_TRACKED_FILES`] per list.
    pub fn new() -> FileTracker {
        FileTracker::default()
    }

    /// An empty tracker keeping at most `limit` files per list.
    pub fn with_limit(limit: usize) -> FileTracker {
        FileTracker {
            read: Vec::new(),
            modified: Vec::new(),
            limit,
            current: None,
        }
    }

    /// This tracker continuing from the lists of a previous compaction (most recent first).
    pub fn with_prior(mut self, read: &[String], modified: &[String]) -> FileTracker {
        for f in read.iter().rev() {
            self.add_read(f);
        }
        for f in modified.iter().rev() {
            self.add_modified(f);
        }
        self
    }

    /// Files read, most recent first.
    pub fn read_files(&self) -> &[String] {
        &self.read
    }

    /// Files modified, most recent first.
    pub fn modified_files(&self) -> &[String] {
        &self.modified
    }

    /// Scans one message: the tool calls and SWE-agent text commands of assistant messages.
    pub fn observe_message(&mut self, message: &Message) {
        if message.role != Role::Assistant {
            return;
        }
        for part in &message.parts {
            match part {
                Part::ToolCall(call) => self.observe_tool_call(&call.name, &call.arguments),
                Part::Text(text) => self.observe_text(text),
                _ => {}
            }
        }
    }

    /// Scans one tool call.
    pub fn observe_tool_call(&mut self, name: &str, arguments: &str) {
        let Some(kind) = classify(name) else { return };
        let args: Value = serde_json::from_str(arguments).unwrap_or(Value::Null);
        let paths = paths_in(&args);
        match kind {
            ToolKind::Read | ToolKind::SweSearch => paths.iter().for_each(|p| self.add_read(p)),
            ToolKind::Search => paths
                .iter()
                .filter(|p| names_a_file(p))
                .for_each(|p| self.add_read(p)),
            ToolKind::Modify => paths.iter().for_each(|p| self.add_modified(p)),
            ToolKind::Patch => {
                paths.iter().for_each(|p| self.add_modified(p));
                let body = match &args {
                    Value::Object(map) => ["input", "patch", "diff", "content"]
                        .iter()
                        .find_map(|k| map.get(*k).and_then(Value::as_str))
                        .unwrap_or_default()
                        .to_string(),
                    Value::String(s) => s.clone(),
                    _ => arguments.to_string(),
                };
                self.observe_patch(&body, true);
            }
            ToolKind::Editor => {
                let command = args.get("command").and_then(Value::as_str).unwrap_or("");
                match command {
                    "view" => paths.iter().for_each(|p| self.add_read(p)),
                    "create" | "str_replace" | "insert" | "undo_edit" | "write" | "edit" => {
                        paths.iter().for_each(|p| self.add_modified(p))
                    }
                    _ => {}
                }
                if let Some(p) = paths.first() {
                    self.current = Some(p.clone());
                }
            }
            ToolKind::SweOpen => {
                paths.iter().for_each(|p| self.add_read(p));
                if let Some(p) = paths.first() {
                    self.current = Some(p.clone());
                }
            }
            ToolKind::SweCreate => {
                paths.iter().for_each(|p| self.add_modified(p));
                if let Some(p) = paths.first() {
                    self.current = Some(p.clone());
                }
            }
            ToolKind::SweEdit => {
                if paths.is_empty() {
                    if let Some(current) = self.current.clone() {
                        self.add_modified(&current);
                    }
                } else {
                    paths.iter().for_each(|p| self.add_modified(p));
                }
            }
            ToolKind::Shell => {
                let command = shell_command(&args).unwrap_or_else(|| {
                    // Not JSON: some harnesses send the command line itself.
                    if args.is_null() {
                        arguments.to_string()
                    } else {
                        String::new()
                    }
                });
                self.observe_command(&command);
            }
        }
    }

    /// Scans assistant text for SWE-agent commands in fenced blocks.
    pub fn observe_text(&mut self, text: &str) {
        if !text.contains("```") {
            return;
        }
        let Some(fenced) = pattern(|p| &p.fenced) else {
            return;
        };
        for block in fenced.captures_iter(text) {
            let Some(body) = block.get(1).map(|m| m.as_str()) else {
                continue;
            };
            let first = body.lines().next().unwrap_or("").trim();
            if let Some(caps) = pattern(|p| &p.swe_open_create).and_then(|r| r.captures(first)) {
                let path = (2..=4).find_map(|i| caps.get(i)).map(|m| m.as_str());
                let (Some(verb), Some(path)) = (caps.get(1), path) else {
                    continue;
                };
                if !looks_like_path(path) {
                    continue;
                }
                if verb.as_str() == "open" {
                    self.add_read(path);
                } else {
                    self.add_modified(path);
                }
                self.current = Some(path.to_string());
            } else if is_match(|p| &p.swe_edit, first) && body.contains("end_of_edit") {
                if let Some(current) = self.current.clone() {
                    self.add_modified(&current);
                }
            }
        }
    }

    /// Scans a shell command line.
    pub fn observe_command(&mut self, command: &str) {
        let mentions_patch = command.contains("patch") || command.contains("git apply");
        self.observe_patch(command, mentions_patch);
        for segment in split_commands(command) {
            self.observe_simple_command(&segment);
        }
    }

    fn observe_patch(&mut self, text: &str, unified_diffs: bool) {
        if let Some(re) = pattern(|p| &p.patch_file) {
            for caps in re.captures_iter(text) {
                if let Some(m) = caps.get(1) {
                    self.add_modified(m.as_str());
                }
            }
        }
        if unified_diffs {
            if let Some(re) = pattern(|p| &p.diff_file) {
                for caps in re.captures_iter(text) {
                    if let Some(m) = caps.get(1) {
                        self.add_modified(m.as_str());
                    }
                }
            }
        }
    }

    fn observe_simple_command(&mut self, cmd: &SimpleCommand) {
        for (kind, target) in &cmd.redirects {
            match kind {
                Redirect::Out => self.add_modified(target),
                Redirect::In => self.add_read(target),
            }
        }
        let mut words = cmd.words.iter().map(String::as_str).peekable();
        // Skip environment assignments and wrappers.
        while let Some(w) = words.peek() {
            if is_match(|p| &p.env_assignment, w)
                || matches!(*w, "sudo" | "env" | "time" | "nohup" | "command" | "exec")
            {
                words.next();
            } else {
                break;
            }
        }
        let Some(program) = words.next() else { return };
        let program = program.rsplit('/').next().unwrap_or(program);
        let rest: Vec<&str> = words.collect();
        // Flags that take a value, per program; `script_flags` supply the pattern/script.
        let (value_flags, script_flags): (&[&str], &[&str]) = match program {
            "head" | "tail" => (&["-n", "-c"], &[]),
            "grep" | "egrep" | "fgrep" | "rg" | "ag" | "ack" => (
                &[
                    "-e", "-f", "-A", "-B", "-C", "-m", "--regexp", "--file", "-g", "--glob",
                ],
                &["-e", "-f", "--regexp", "--file"],
            ),
            "sed" => (
                &["-e", "-f", "--expression", "--file"],
                &["-e", "-f", "--expression", "--file"],
            ),
            "awk" | "gawk" => (&["-F", "-v", "-f"], &["-f"]),
            "cp" | "mv" => (&["-t", "--target-directory", "-S", "--suffix"], &[]),
            "tee" | "touch" => (&["-d", "-r", "-t"], &[]),
            _ => (&[], &[]),
        };
        let mut positional: Vec<&str> = Vec::new();
        let mut has_script_flag = false;
        let mut in_place = false;
        let mut target_dir: Option<&str> = None;
        let mut iter = rest.iter();
        let mut options_done = false;
        while let Some(w) = iter.next() {
            if !options_done && *w == "--" {
                options_done = true;
                continue;
            }
            if !options_done && w.starts_with('-') && w.len() > 1 {
                if program == "sed" && (w.starts_with("-i") || *w == "--in-place") {
                    in_place = true;
                }
                if value_flags.contains(w) {
                    let value = iter.next();
                    if script_flags.contains(w) {
                        has_script_flag = true;
                    }
                    if matches!(*w, "-t" | "--target-directory") {
                        target_dir = value.copied();
                    }
                }
                continue;
            }
            positional.push(w);
        }
        let operands = |skip_script: bool| -> Vec<&str> {
            let skip = usize::from(skip_script && !has_script_flag);
            positional.iter().skip(skip).copied().collect()
        };
        match program {
            "cat" | "head" | "tail" | "less" | "more" | "bat" | "nl" | "wc" | "tac" | "xxd"
            | "diff" | "cmp" => operands(false).iter().for_each(|p| self.add_read(p)),
            "grep" | "egrep" | "fgrep" | "rg" | "ag" | "ack" | "awk" | "gawk" => {
                operands(true).iter().for_each(|p| self.add_read(p))
            }
            "sed" => {
                let files = operands(true);
                if in_place {
                    files.iter().for_each(|p| self.add_modified(p));
                } else {
                    files.iter().for_each(|p| self.add_read(p));
                }
            }
            "tee" | "touch" | "rm" | "truncate" | "unlink" => {
                operands(false).iter().for_each(|p| self.add_modified(p))
            }
            "cp" | "mv" => {
                let ops = operands(false);
                let (sources, dest) = match target_dir {
                    Some(dir) => (&ops[..], Some(dir)),
                    None => match ops.split_last() {
                        Some((last, init)) if !init.is_empty() => (init, Some(*last)),
                        _ => (&ops[..0], None),
                    },
                };
                if program == "cp" {
                    sources.iter().for_each(|p| self.add_read(p));
                }
                if let Some(d) = dest {
                    self.add_modified(d);
                }
            }
            _ => {}
        }
    }

    fn add_read(&mut self, path: &str) {
        touch(&mut self.read, path, self.limit);
    }

    fn add_modified(&mut self, path: &str) {
        touch(&mut self.modified, path, self.limit);
    }
}

/// Moves `path` to the front of `list` (most recent first), keeping at most `limit` entries.
/// Lists are short (bounded by `limit`), so a linear search beats keeping a set beside them.
fn touch(list: &mut Vec<String>, path: &str, limit: usize) {
    let path = clean(path);
    if !looks_like_path(path) {
        return;
    }
    match list.iter().position(|f| f == path) {
        Some(0) => {}
        Some(i) => list[..=i].rotate_right(1),
        None => {
            list.insert(0, path.to_string());
            list.truncate(limit);
        }
    }
}

fn clean(path: &str) -> &str {
    path.trim()
        .trim_matches(|c| c == '"' || c == '\'' || c == '`')
}

/// Whether an operand is plausibly a file path (not a flag, number, URL, glob or expansion).
fn looks_like_path(p: &str) -> bool {
    !p.is_empty()
        && p.len() <= 4096
        && !p.starts_with('-')
        && !matches!(p, "." | ".." | "/" | "~" | "-")
        && !p.bytes().all(|b| b.is_ascii_digit())
        && !p.contains("://")
        && !p.starts_with("/dev/")
        && !p.starts_with("/proc/")
        && !p.chars().any(|c| "*?[]{}$`<>|;&()=\n\r\0".contains(c))
}

/// Whether a search path names a file (its last segment has an extension) rather than a
/// directory.
fn names_a_file(path: &str) -> bool {
    let path = clean(path);
    !path.ends_with('/')
        && path
            .rsplit('/')
            .next()
            .and_then(|name| name.rsplit_once('.'))
            .is_some_and(|(stem, ext)| !stem.is_empty() && !ext.is_empty())
}

/// The file paths named in a tool's arguments.
fn paths_in(args: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let Value::Object(map) = args else {
        return out;
    };
    for key in PATH_KEYS {
        if let Some(p) = map.get(*key).and_then(Value::as_str) {
            out.push(p.to_string());
        }
    }
    for key in PATHS_KEYS {
        if let Some(Value::Array(items)) = map.get(*key) {
            for item in items {
                match item {
                    Value::String(p) => out.push(p.clone()),
                    Value::Object(o) => {
                        if let Some(p) = PATH_KEYS.iter().find_map(|k| o.get(*k)?.as_str()) {
                            out.push(p.to_string());
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    out
}

/// The command line in a shell tool's arguments: `command`/`cmd`/`script` as a string, or an
/// argv array (`["bash", "-lc", "cat x"]` → `cat x`).
fn shell_command(args: &Value) -> Option<String> {
    let value = match args {
        Value::String(s) => return Some(s.clone()),
        Value::Object(map) => ["command", "cmd", "script"]
            .iter()
            .find_map(|k| map.get(*k))?,
        _ => return None,
    };
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Array(items) => {
            let argv: Vec<&str> = items.iter().filter_map(Value::as_str).collect();
            let script = argv
                .iter()
                .position(|a| matches!(*a, "-c" | "-lc" | "-ic" | "-cl"))
                .and_then(|i| argv.get(i + 1));
            Some(match script {
                Some(s) => s.to_string(),
                None => argv.join(" "),
            })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn track(calls: &[(&str, &str)]) -> (Vec<String>, Vec<String>) {
        let mut t = FileTracker::new();
        for (name, args) in calls {
            t.observe_tool_call(name, args);
        }
        (t.read_files().to_vec(), t.modified_files().to_vec())
    }

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn every_pattern_compiles() {
        if let Err(e) = Patterns::compile() {
            panic!("a file-tracking pattern does not compile: {e}");
        }
        assert!(PATTERNS.is_some());
    }

    /// `Regex::new` anywhere else in `src/` would be a pattern no test compiles: it belongs in
    /// [`Patterns`] (or in a set of its own with a test like `every_pattern_compiles`, listed
    /// here).
    #[test]
    fn regexes_are_compiled_only_in_patterns() {
        // `config.rs` compiles the operator's own patterns, where validation names one that
        // does not compile.
        const COMPILED_AND_TESTED: [&str; 2] = ["compaction/files.rs", "config.rs"];
        let needle = concat!("Regex", "::new(");
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut pending = vec![root.clone()];
        let mut offenders = Vec::new();
        while let Some(dir) = pending.pop() {
            for entry in std::fs::read_dir(&dir).expect("read src/") {
                let path = entry.expect("dir entry").path();
                if path.is_dir() {
                    pending.push(path);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    let text = std::fs::read_to_string(&path).expect("read source");
                    let relative = path.strip_prefix(&root).expect("under src/");
                    let relative = relative.to_string_lossy().replace('\\', "/");
                    if text.contains(needle) && !COMPILED_AND_TESTED.contains(&relative.as_str()) {
                        offenders.push(relative);
                    }
                }
            }
        }
        assert!(
            offenders.is_empty(),
            "Regex::new outside Patterns: {offenders:?}"
        );
    }

    #[test]
    fn basic_tools_read_and_modify() {
        let (read, modified) = track(&[
            ("read", r#"{"file_path":"/a.go"}"#),
            ("write", r#"{"file_path":"/b.go"}"#),
            ("edit", r#"{"path":"/c.go"}"#),
            ("patch", r#"{"file":"/d.go"}"#),
            (
                "apply_patch",
                r#"{"input":"*** Begin Patch\n*** Update File: /e.go\n@@\n*** Add File: f.go\n*** End Patch"}"#,
            ),
        ]);
        assert_eq!(read, s(&["/a.go"]));
        assert_eq!(modified, s(&["f.go", "/e.go", "/d.go", "/c.go", "/b.go"]));
    }

    #[test]
    fn tool_name_variants_are_case_insensitive() {
        let (read, modified) = track(&[
            ("Read", r#"{"file_path":"r1"}"#),
            ("read_file", r#"{"path":"r2"}"#),
            ("view", r#"{"path":"r3"}"#),
            ("mcp__fs__read_file", r#"{"path":"r4"}"#),
            ("Edit", r#"{"file_path":"m1"}"#),
            ("MultiEdit", r#"{"file_path":"m2","edits":[]}"#),
            ("Write", r#"{"file_path":"m3"}"#),
            ("write_file", r#"{"filename":"m4"}"#),
            ("edit_file", r#"{"target_file":"m5"}"#),
            ("create", r#"{"path":"m6"}"#),
            ("unknown_tool", r#"{"path":"nope"}"#),
        ]);
        assert_eq!(read, s(&["r4", "r3", "r2", "r1"]));
        assert_eq!(modified, s(&["m6", "m5", "m4", "m3", "m2", "m1"]));
    }

    #[test]
    fn str_replace_editor_commands() {
        let (read, modified) = track(&[
            (
                "str_replace_editor",
                r#"{"command":"view","path":"/repo/a.py"}"#,
            ),
            (
                "str_replace_editor",
                r#"{"command":"create","path":"/repo/b.py","file_text":"x"}"#,
            ),
            (
                "str_replace_based_edit_tool",
                r#"{"command":"str_replace","path":"/repo/a.py"}"#,
            ),
            (
                "str_replace_editor",
                r#"{"command":"insert","path":"/repo/c.py"}"#,
            ),
        ]);
        assert_eq!(read, s(&["/repo/a.py"]));
        assert_eq!(modified, s(&["/repo/c.py", "/repo/a.py", "/repo/b.py"]));
    }

    #[test]
    fn shell_commands_by_regex_and_words() {
        let (read, modified) = track(&[
            (
                "bash",
                r#"{"command":"cat src/main.rs | head -n 20 README.md && grep -rn 'fn main' src/lib.rs"}"#,
            ),
            (
                "shell",
                r#"{"command":["bash","-lc","sed -i 's/a/b/' x.py; echo hi > out.txt 2>&1"]}"#,
            ),
            (
                "Bash",
                r#"{"command":"tail -f log.txt; tee -a t.log < in.txt; touch new.rs; rm -rf build"}"#,
            ),
            (
                "bash",
                r#"{"command":"mv a.txt b.txt && cp c.txt d.txt && echo x >> app.log 2>/dev/null"}"#,
            ),
            (
                "bash",
                r#"{"command":"python run.py > /dev/null; ls -la; sed -n '1,5p' cfg.toml"}"#,
            ),
        ]);
        assert_eq!(
            read,
            s(&[
                "cfg.toml",
                "c.txt",
                "in.txt",
                "log.txt",
                "src/lib.rs",
                "README.md",
                "src/main.rs",
            ])
        );
        assert_eq!(
            modified,
            s(&["app.log", "d.txt", "b.txt", "build", "new.rs", "t.log", "out.txt", "x.py"])
        );
    }

    #[test]
    fn heredocs_quotes_and_comments_are_understood() {
        let (read, modified) = track(&[(
            "bash",
            r#"{"command":"cat > 'my file.py' <<'EOF'\nrm -rf /important\ncat secret\nEOF\n# cat commented\ngrep -e pat \"a b.txt\""}"#,
        )]);
        assert_eq!(read, s(&["a b.txt"]));
        assert_eq!(modified, s(&["my file.py"]));
        let (_, modified) = track(&[(
            "bash",
            r#"{"command":"apply_patch <<'PATCH'\n*** Begin Patch\n*** Update File: src/x.rs\n*** End Patch\nPATCH"}"#,
        )]);
        assert_eq!(modified, s(&["src/x.rs"]));
        let (_, modified) = track(&[(
            "bash",
            r#"{"command":"git apply <<EOF\n--- a/y.rs\n+++ b/y.rs\n@@\nEOF"}"#,
        )]);
        assert_eq!(modified, s(&["y.rs"]));
    }

    #[test]
    fn claude_code_tools_are_tracked() {
        let (read, modified) = track(&[
            (
                "Read",
                r#"{"file_path":"/repo/src/a.rs","offset":10,"limit":50}"#,
            ),
            (
                "Write",
                r#"{"file_path":"/repo/new.rs","content":"fn x() {}"}"#,
            ),
            (
                "Edit",
                r#"{"file_path":"/repo/src/a.rs","old_string":"a","new_string":"b"}"#,
            ),
            (
                "MultiEdit",
                r#"{"file_path":"/repo/src/b.rs","edits":[{"old_string":"x","new_string":"y"}]}"#,
            ),
            (
                "NotebookEdit",
                r#"{"notebook_path":"/repo/nb.ipynb","new_source":"print(1)"}"#,
            ),
            (
                "Bash",
                r#"{"command":"cat Cargo.toml && rm -f old.log","description":"x"}"#,
            ),
            (
                "Grep",
                r#"{"pattern":"fn main","path":"/repo/src/main.rs"}"#,
            ),
            (
                "Grep",
                r#"{"pattern":"fn main","path":"/repo/src","glob":"*.rs"}"#,
            ),
            ("Glob", r#"{"pattern":"**/*.rs","path":"/repo"}"#),
        ]);
        assert_eq!(
            read,
            s(&["/repo/src/main.rs", "Cargo.toml", "/repo/src/a.rs"])
        );
        assert_eq!(
            modified,
            s(&[
                "old.log",
                "/repo/nb.ipynb",
                "/repo/src/b.rs",
                "/repo/src/a.rs",
                "/repo/new.rs",
            ])
        );
    }

    #[test]
    fn codex_tools_are_tracked() {
        let patch = "*** Begin Patch\n*** Update File: src/lib.rs\n@@\n-a\n+b\n\
                     *** Add File: docs/new.md\n+hi\n*** Delete File: old.txt\n*** End Patch";
        let (read, modified) = track(&[
            (
                "shell",
                r#"{"command":["bash","-lc","cat foo.txt | grep x"],"workdir":"/r"}"#,
            ),
            ("shell", r#"{"command":["sed","-n","1,20p","src/main.rs"]}"#),
            (
                "shell",
                &format!(r#"{{"command":["apply_patch","{patch}"]}}"#),
            ),
            (
                "local_shell",
                r#"{"type":"exec","command":["bash","-lc","echo hi > out.txt"]}"#,
            ),
            // The freeform `apply_patch` tool (a Responses `custom_tool_call`): the input is
            // the patch itself, not JSON.
            (
                "apply_patch",
                "*** Begin Patch
*** Update File: src/free.rs
@@
-x
+y
*** End Patch",
            ),
        ]);
        assert_eq!(read, s(&["src/main.rs", "foo.txt"]));
        assert_eq!(
            modified,
            s(&[
                "src/free.rs",
                "out.txt",
                "old.txt",
                "docs/new.md",
                "src/lib.rs",
            ])
        );
    }

    #[test]
    fn non_json_shell_arguments_are_the_command() {
        let (read, _) = track(&[("bash", "cat notes.md")]);
        assert_eq!(read, s(&["notes.md"]));
    }

    #[test]
    fn not_paths_are_ignored() {
        let (read, modified) = track(&[(
            "bash",
            r#"{"command":"cat $HOME/x *.rs https://x.y/z 42 - && head -n 5 && rm -- -weird"}"#,
        )]);
        assert!(read.is_empty(), "{read:?}");
        assert!(modified.is_empty(), "{modified:?}");
    }

    #[test]
    fn lists_keep_the_most_recent_first_and_carry_forward() {
        let mut t = FileTracker::new().with_prior(&s(&["old.rs", "older.rs"]), &s(&["gone.rs"]));
        assert_eq!(
            t.read_files(),
            s(&["old.rs", "older.rs"]),
            "prior order kept"
        );
        t.observe_tool_call("read", r#"{"path":"new.rs"}"#);
        t.observe_tool_call("read", r#"{"path":"older.rs"}"#);
        t.observe_tool_call("write", r#"{"path":"gone.rs"}"#);
        t.observe_tool_call("write", r#"{"path":"new.rs"}"#);
        assert_eq!(t.read_files(), s(&["older.rs", "new.rs", "old.rs"]));
        assert_eq!(t.modified_files(), s(&["new.rs", "gone.rs"]));
    }

    #[test]
    fn lists_are_bounded_dropping_the_least_recent() {
        assert_eq!(DEFAULT_MAX_TRACKED_FILES, 50);
        assert_eq!(FileTracker::new().limit, DEFAULT_MAX_TRACKED_FILES);
        let mut t = FileTracker::with_limit(3);
        for i in 0..10 {
            t.observe_tool_call("read", &format!(r#"{{"path":"src/f{i}.rs"}}"#));
        }
        t.observe_tool_call("read", r#"{"path":"src/f8.rs"}"#);
        assert_eq!(t.read_files(), s(&["src/f8.rs", "src/f9.rs", "src/f7.rs"]));
        // A prior list longer than the limit is cut to its most recent entries.
        let prior: Vec<String> = (0..10).map(|i| format!("p{i}.rs")).collect();
        let t = FileTracker::with_limit(4).with_prior(&prior, &[]);
        assert_eq!(t.read_files(), s(&["p0.rs", "p1.rs", "p2.rs", "p3.rs"]));
    }

    #[test]
    fn text_mode_needs_the_exact_command_shape() {
        let mut t = FileTracker::new();
        t.observe_text("Run this:\n```bash\nopen the door please\n```");
        t.observe_text("```\nedit 1:2\nno terminator\n```");
        t.observe_text("```\nopen \"src/app.py\" 40\n```\n```\nedit 3:4\nx = 1\nend_of_edit\n```");
        assert_eq!(t.read_files(), s(&["src/app.py"]));
        assert_eq!(t.modified_files(), s(&["src/app.py"]));
    }
}
