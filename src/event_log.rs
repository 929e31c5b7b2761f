//! The compaction event log (`server.event_log`): one JSON line per thing compactor did to a
//! conversation, for an operator reading back a day without a metrics stack.
//!
//! Events: a compaction (on the request path, made ahead in the background, or asked for by
//! the admin API), a mask step (a conversation masking more old tool outputs than its previous
//! request did), a refusal for length compacted and sent again, and a compaction that failed
//! (summarizer error or timeout, a blank summary, ...). Each line carries the time (seconds
//! since the Unix epoch), the session, and what is known of trigger, tokens before and after,
//! summarizer, duration and the summarizer's cost; never message contents or credentials.
//!
//! The file is bounded: when a line would take it past `server.event_log_max_bytes` it is
//! renamed to `<path>.1` (replacing the previous one) and a new file is started, so at most
//! twice the bound is on disk. Writes are appends of one line under a lock, small enough not to
//! matter on the paths that make them (events are per compaction, not per request). A write
//! that fails is logged once per failure and dropped: the log never fails a request.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// Sessions whose masked count is remembered at most (forgotten all at once when full: at
/// worst one mask step logged twice).
const MAX_SESSIONS: usize = 16_384;

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Older turns were replaced by a summary.
    Compaction,
    /// More old tool outputs were masked than in the conversation's previous request.
    MaskStep,
    /// A refusal for length was compacted and sent again.
    Retry,
    /// A compaction was due and did not happen.
    CompactionFailed,
}

/// One line of the log.
#[derive(Debug, Clone, Serialize)]
pub struct Event<'a> {
    /// Seconds since the Unix epoch (filled in when written).
    pub ts: f64,
    /// What happened.
    pub event: Kind,
    /// The conversation.
    pub session: &'a str,
    /// What triggered it (`messages`, `tokens`, `cost`, `overflow`, `manual`, ...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trigger: Option<&'a str>,
    /// For a failure: why (`failed`, `timeout`, `blank`, `breaker`, ...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outcome: Option<&'a str>,
    /// Estimated input tokens before.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_before: Option<usize>,
    /// Estimated input tokens after.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_after: Option<usize>,
    /// For a mask step: tool outputs masked now.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub masked_outputs: Option<usize>,
    /// The summarizer backend.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub summarizer: Option<&'a str>,
    /// How long it took, in milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<f64>,
    /// What the summarizer's calls cost, in USD (priced models that report usage).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost_usd: Option<f64>,
}

impl<'a> Event<'a> {
    /// An event of `kind` for `session`, every figure unset.
    pub fn new(event: Kind, session: &'a str) -> Event<'a> {
        Event {
            ts: 0.0,
            event,
            session,
            trigger: None,
            outcome: None,
            tokens_before: None,
            tokens_after: None,
            masked_outputs: None,
            summarizer: None,
            duration_ms: None,
            cost_usd: None,
        }
    }

    /// With tokens before and after.
    pub fn tokens(self, before: usize, after: usize) -> Self {
        Event {
            tokens_before: Some(before),
            tokens_after: Some(after),
            ..self
        }
    }

    /// With a duration.
    pub fn took(self, duration: Duration) -> Self {
        Event {
            duration_ms: Some(duration.as_secs_f64() * 1e3),
            ..self
        }
    }
}

/// The open event log.
#[derive(Debug)]
pub struct EventLog {
    path: PathBuf,
    max_bytes: u64,
    file: Mutex<Open>,
    /// Each session's masked outputs in its latest request (for telling a mask step).
    masked: Mutex<HashMap<String, usize>>,
}

#[derive(Debug)]
struct Open {
    file: File,
    written: u64,
}

impl EventLog {
    /// Opens (appending to) `path`, bounded by `max_bytes` before rotation.
    pub fn open(path: &Path, max_bytes: u64) -> std::io::Result<EventLog> {
        let file = append(path)?;
        let written = file.metadata()?.len();
        Ok(EventLog {
            path: path.to_path_buf(),
            max_bytes: max_bytes.max(1),
            file: Mutex::new(Open { file, written }),
            masked: Mutex::new(HashMap::new()),
        })
    }

    /// The file it writes.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `event` as one line, stamped with the time now.
    pub fn record(&self, mut event: Event<'_>) {
        event.ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let mut line = match serde_json::to_vec(&event) {
            Ok(line) => line,
            Err(e) => {
                tracing::warn!(error = %e, "event not written");
                return;
            }
        };
        line.push(b'\n');
        let mut open = self.file.lock().unwrap_or_else(PoisonError::into_inner);
        if let Err(e) = self.write(&mut open, &line) {
            tracing::warn!(path = %self.path.display(), error = %e, "event log write failed; event dropped");
        }
    }

    fn write(&self, open: &mut Open, line: &[u8]) -> std::io::Result<()> {
        let len = line.len() as u64;
        if open.written > 0 && open.written + len > self.max_bytes {
            let mut rotated = self.path.clone().into_os_string();
            rotated.push(".1");
            std::fs::rename(&self.path, rotated)?;
            *open = Open {
                file: append(&self.path)?,
                written: 0,
            };
        }
        open.file.write_all(line)?;
        open.written += len;
        Ok(())
    }

    /// Notes that a request of `session` forwards `masked` old outputs masked, and logs a
    /// mask step when that is more than its previous request did (`before` and `after`: the
    /// request's estimated tokens unmasked and as forwarded).
    pub fn masked(&self, session: &str, masked: usize, before: usize, after: usize) {
        let stepped = {
            let mut seen = self.masked.lock().unwrap_or_else(PoisonError::into_inner);
            let last = match seen.get_mut(session) {
                Some(last) => std::mem::replace(last, masked),
                None => {
                    if seen.len() >= MAX_SESSIONS {
                        seen.clear();
                    }
                    seen.insert(session.to_string(), masked);
                    0
                }
            };
            masked > last
        };
        if stepped {
            self.record(Event {
                masked_outputs: Some(masked),
                ..Event::new(Kind::MaskStep, session).tokens(before, after)
            });
        }
    }
}

/// A recorded event log read back (`compactor replay --events`): per conversation, in the
/// order each first appears, what compactor did to it (compactions, refusal retries, mask
/// steps, failures), the estimated tokens its compactions and retries removed, and what its
/// summaries cost; then the totals. Lines that are not events (a line cut off by a crash)
/// are counted and skipped; `Err` names the first when none is an event.
pub fn report(text: &str) -> Result<String, String> {
    #[derive(Default)]
    struct Row {
        compactions: u64,
        retries: u64,
        mask_steps: u64,
        failures: u64,
        removed: u64,
        usd: f64,
    }
    let mut rows: Vec<(String, Row)> = Vec::new();
    let (mut skipped, mut first_bad) = (0usize, None);
    let (mut first, mut last) = (f64::INFINITY, f64::NEG_INFINITY);
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let event: serde_json::Value = match serde_json::from_str(line) {
            Ok(v @ serde_json::Value::Object(_)) if v["event"].is_string() => v,
            _ => {
                skipped += 1;
                first_bad.get_or_insert(i + 1);
                continue;
            }
        };
        let session = event["session"].as_str().unwrap_or("-").to_string();
        let at = match rows.iter().position(|(s, _)| *s == session) {
            Some(at) => at,
            None => {
                rows.push((session, Row::default()));
                rows.len() - 1
            }
        };
        let row = &mut rows[at].1;
        if let Some(ts) = event["ts"].as_f64() {
            first = first.min(ts);
            last = last.max(ts);
        }
        let removed = match (
            event["tokens_before"].as_u64(),
            event["tokens_after"].as_u64(),
        ) {
            (Some(b), Some(a)) => b.saturating_sub(a),
            _ => 0,
        };
        match event["event"].as_str() {
            Some("compaction") => {
                row.compactions += 1;
                row.removed += removed;
            }
            Some("retry") => {
                row.retries += 1;
                row.removed += removed;
            }
            Some("mask_step") => row.mask_steps += 1,
            Some("compaction_failed") => row.failures += 1,
            _ => {}
        }
        row.usd += event["cost_usd"].as_f64().unwrap_or(0.0);
    }
    if rows.is_empty() {
        return Err(match first_bad {
            Some(line) => format!("line {line} is not an event"),
            None => "no events".to_string(),
        });
    }
    let mut out = format!(
        "{:<20}  {:>11}  {:>7}  {:>10}  {:>8}  {:>14}  {:>14}\n",
        "session",
        "compactions",
        "retries",
        "mask_steps",
        "failures",
        "tokens_removed",
        "summaries_usd"
    );
    let mut total = Row::default();
    for (session, r) in &rows {
        out.push_str(&format!(
            "{session:<20}  {:>11}  {:>7}  {:>10}  {:>8}  {:>14}  {:>14.4}\n",
            r.compactions, r.retries, r.mask_steps, r.failures, r.removed, r.usd
        ));
        total.compactions += r.compactions;
        total.retries += r.retries;
        total.mask_steps += r.mask_steps;
        total.failures += r.failures;
        total.removed += r.removed;
        total.usd += r.usd;
    }
    let span = if last > first { last - first } else { 0.0 };
    out.push_str(&format!(
        "total: {} conversations over {:.1} h: {} compactions, {} refusal retries, {} mask steps, \
         {} failed compactions, {} estimated tokens removed, ${:.4} of summaries",
        rows.len(),
        span / 3600.0,
        total.compactions,
        total.retries,
        total.mask_steps,
        total.failures,
        total.removed,
        total.usd
    ));
    if skipped > 0 {
        out.push_str(&format!("; {skipped} line(s) not events skipped"));
    }
    out.push('\n');
    Ok(out)
}

fn append(path: &Path) -> std::io::Result<File> {
    OpenOptions::new().create(true).append(true).open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(path: &Path) -> Vec<serde_json::Value> {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).expect("a JSON line"))
            .collect()
    }

    #[test]
    fn events_are_json_lines_and_the_file_rotates_at_its_bound() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("events.jsonl");
        let log = EventLog::open(&path, 600).expect("open");
        for i in 0..10 {
            log.record(
                Event {
                    trigger: Some("tokens"),
                    summarizer: Some("auto"),
                    ..Event::new(Kind::Compaction, "s1").tokens(1000 + i, 200)
                }
                .took(Duration::from_millis(1500)),
            );
        }
        let current = lines(&path);
        let mut rotated = path.clone().into_os_string();
        rotated.push(".1");
        let previous = lines(Path::new(&rotated));
        assert!(std::fs::metadata(&path).expect("file").len() <= 600);
        assert!(!previous.is_empty() && !current.is_empty());
        // The newest events are in the current file, the ones before in `.1`; older ones
        // were dropped with the bound.
        let last = current.last().expect("an event");
        assert_eq!(last["tokens_before"], 1009);
        assert_eq!(last["event"], "compaction");
        assert_eq!(last["session"], "s1");
        assert_eq!(last["trigger"], "tokens");
        assert_eq!(last["duration_ms"], 1500.0);
        assert!(last["ts"].as_f64().is_some_and(|t| t > 1.7e9));
        assert!(last.get("cost_usd").is_none(), "unset figures are left out");
        let befores: Vec<u64> = previous
            .iter()
            .chain(&current)
            .map(|e| e["tokens_before"].as_u64().expect("tokens"))
            .collect();
        assert!(befores.windows(2).all(|w| w[1] == w[0] + 1), "{befores:?}");
        assert_eq!(befores.last(), Some(&1009));

        // Reopened: appends.
        drop(log);
        let log = EventLog::open(&path, 1 << 20).expect("reopen");
        log.record(Event::new(Kind::Retry, "s2"));
        assert_eq!(lines(&path).last().expect("event")["event"], "retry");
    }

    #[test]
    fn a_recorded_log_reads_back_per_conversation() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("events.jsonl");
        let log = EventLog::open(&path, 1 << 20).expect("open");
        log.record(Event {
            cost_usd: Some(0.25),
            ..Event::new(Kind::Compaction, "a").tokens(9000, 2000)
        });
        log.record(Event::new(Kind::Retry, "b").tokens(5000, 3000));
        log.masked("a", 10, 4000, 3000);
        log.record(Event::new(Kind::CompactionFailed, "b"));
        log.record(Event::new(Kind::Compaction, "a").tokens(8000, 2500));
        let mut text = std::fs::read_to_string(&path).expect("log");
        text.push_str("{\"event\": \"compac"); // cut off by a crash
        let shown = report(&text).expect("a report");
        let lines: Vec<Vec<&str>> = shown
            .lines()
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(lines[1], ["a", "2", "0", "1", "0", "12500", "0.2500"]);
        assert_eq!(lines[2], ["b", "0", "1", "0", "1", "2000", "0.0000"]);
        assert!(
            shown.contains("total: 2 conversations over 0.0 h: 2 compactions, 1 refusal retries, 1 mask steps, 1 failed compactions, 14500 estimated tokens removed, $0.2500 of summaries; 1 line(s) not events skipped"),
            "{shown}"
        );
        assert_eq!(report("not json\n"), Err("line 1 is not an event".into()));
    }

    #[test]
    fn a_mask_step_is_logged_when_a_session_masks_more_than_before() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("events.jsonl");
        let log = EventLog::open(&path, 1 << 20).expect("open");
        for (session, masked) in [
            ("a", 0),
            ("a", 10),
            ("a", 10),
            ("b", 10),
            ("a", 20),
            ("a", 20),
        ] {
            log.masked(session, masked, 5000, 3000);
        }
        let steps: Vec<(String, u64)> = lines(&path)
            .iter()
            .map(|e| {
                assert_eq!(e["event"], "mask_step");
                (
                    e["session"].as_str().expect("session").to_string(),
                    e["masked_outputs"].as_u64().expect("masked"),
                )
            })
            .collect();
        assert_eq!(
            steps,
            [("a".into(), 10), ("b".into(), 10), ("a".into(), 20)]
        );
    }
}
