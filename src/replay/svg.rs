//! The replay chart: one hand-written SVG document with one panel per replayed file, stacked
//! top to bottom in the order given.
//!
//! Each panel plots the estimated input tokens received (blue) and forwarded (red) per step as
//! two polylines, a circle on the forwarded line at every step where a compaction happened
//! (`class="compaction"`, with a tooltip), a grey cross at every step where a due compaction
//! failed (`class="failed"`), and the model's token threshold as a dashed horizontal line. The
//! y axis reaches the threshold, so the headroom left by a conversation shows as the gap under
//! the dashed line, unless the threshold is more than twice the largest request: the line then
//! runs along the top edge, labelled "off scale", so the conversation is not flattened against
//! the axis. Panels are titled with the file name (the full path in a tooltip), the model, the
//! summarizer and the counts. Every piece of text is escaped.

use std::fmt::{self, Write as _};

use super::{Event, FileReport, Missed};

/// Width of the document.
const WIDTH: f64 = 760.0;
/// Widths a character of the panel title (14 px bold) and of its figures (12 px) take at
/// most, for keeping the two apart.
const TITLE_CHAR: f64 = 9.0;
const FIGURES_CHAR: f64 = 6.6;
/// Height of one panel.
const PANEL: f64 = 340.0;
const LEFT: f64 = 72.0;
const RIGHT: f64 = 24.0;
const TOP: f64 = 56.0;
const BOTTOM: f64 = 48.0;

/// The threshold is drawn off scale when it exceeds the peak received this many times.
const OFF_SCALE: usize = 2;

const RECEIVED: &str = "#1f77b4";
const FORWARDED: &str = "#d62728";
const THRESHOLD: &str = "#555555";
const MARKER: &str = "#ff7f0e";
const FAILED: &str = "#7f7f7f";

/// The chart of `reports`, one panel each.
pub fn render(reports: &[FileReport]) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = document(&mut out, reports);
    out
}

fn document(out: &mut String, reports: &[FileReport]) -> fmt::Result {
    let height = PANEL * reports.len().max(1) as f64;
    writeln!(out, r#"<?xml version="1.0" encoding="UTF-8"?>"#)?;
    writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">"#
    )?;
    writeln!(
        out,
        r#"<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="white"/>"#
    )?;
    for (i, report) in reports.iter().enumerate() {
        panel(out, report, PANEL * i as f64)?;
    }
    writeln!(out, "</svg>")
}

/// Maps steps and tokens to panel coordinates.
struct Scale {
    steps: usize,
    y_max: f64,
}

impl Scale {
    fn x(&self, step: usize) -> f64 {
        let (x0, x1) = (LEFT, WIDTH - RIGHT);
        if self.steps <= 1 {
            return (x0 + x1) / 2.0;
        }
        x0 + (step.saturating_sub(1)) as f64 / (self.steps - 1) as f64 * (x1 - x0)
    }

    fn y(&self, tokens: usize) -> f64 {
        let (y0, y1) = (TOP, PANEL - BOTTOM);
        y1 - (tokens as f64 / self.y_max).min(1.0) * (y1 - y0)
    }
}

fn panel(out: &mut String, report: &FileReport, offset: f64) -> fmt::Result {
    let threshold = report.limits.token_threshold;
    let peak = report.peak_received().max(1);
    // A threshold far above the conversation would flatten it against the axis: it is then
    // drawn along the top edge and labelled as off scale.
    let off_scale = threshold > peak.saturating_mul(OFF_SCALE);
    let top_value = if off_scale { peak } else { peak.max(threshold) } as f64;
    let y_step = nice_step(top_value, 5);
    let scale = Scale {
        steps: report.rows.len(),
        y_max: (top_value / y_step).ceil() * y_step,
    };
    let (x0, x1, y0, y1) = (LEFT, WIDTH - RIGHT, TOP, PANEL - BOTTOM);

    writeln!(
        out,
        r#"<g class="panel" transform="translate(0 {offset})">"#
    )?;
    let figures = format!(
        "{}, {}, {}: {} compactions, {} summarizer calls, {} failed",
        report.strategy.label(),
        report.model.as_deref().unwrap_or("no model"),
        report.summarizer,
        report.compactions(),
        report.summarizer_calls(),
        report.failed_compactions()
    );
    // The file name gets the width the figures leave (with a gap), never more: a long name is
    // clipped, its full path in the tooltip.
    let room = (x1 - x0 - FIGURES_CHAR * figures.chars().count() as f64 - 16.0).max(0.0);
    let name_chars = ((room / TITLE_CHAR) as usize).max(8);
    writeln!(
        out,
        r#"<text class="title" x="{LEFT}" y="20" font-size="14" font-weight="bold">{}<title>{}</title></text>"#,
        escape(&clip(file_name(&report.name), name_chars)),
        escape(&report.name)
    )?;
    writeln!(
        out,
        r##"<text class="figures" x="{x1}" y="20" text-anchor="end" fill="#333333">{}</text>"##,
        escape(&figures)
    )?;
    legend(out)?;

    // Horizontal grid with token labels, then step ticks.
    let mut value = 0.0;
    while value <= scale.y_max + y_step / 2.0 {
        let y = scale.y(value as usize);
        writeln!(
            out,
            r##"<line x1="{x0}" y1="{y:.1}" x2="{x1}" y2="{y:.1}" stroke="#e5e5e5"/>"##
        )?;
        writeln!(
            out,
            r#"<text x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
            x0 - 6.0,
            y + 4.0,
            escape(&tokens_label(value))
        )?;
        value += y_step;
    }
    for step in step_ticks(report.rows.len()) {
        let x = scale.x(step);
        writeln!(
            out,
            r##"<line x1="{x:.1}" y1="{y1}" x2="{x:.1}" y2="{}" stroke="#333333"/>"##,
            y1 + 5.0
        )?;
        writeln!(
            out,
            r#"<text x="{x:.1}" y="{}" text-anchor="middle">{step}</text>"#,
            y1 + 18.0
        )?;
    }
    writeln!(
        out,
        r##"<line class="axis" x1="{x0}" y1="{y1}" x2="{x1}" y2="{y1}" stroke="#333333"/>"##
    )?;
    writeln!(
        out,
        r##"<line class="axis" x1="{x0}" y1="{y0}" x2="{x0}" y2="{y1}" stroke="#333333"/>"##
    )?;
    writeln!(
        out,
        r#"<text x="{:.1}" y="{}" text-anchor="middle">step (request sent)</text>"#,
        (x0 + x1) / 2.0,
        PANEL - 12.0
    )?;
    let mid = (y0 + y1) / 2.0;
    writeln!(
        out,
        r#"<text x="16" y="{mid}" text-anchor="middle" transform="rotate(-90 16 {mid})">estimated input tokens</text>"#
    )?;

    // The threshold, then the two series, then the compaction markers on top.
    let ty = if off_scale { y0 } else { scale.y(threshold) };
    let threshold_label = if off_scale {
        format!("token threshold {threshold} (off scale, above)")
    } else {
        format!("token threshold {threshold}")
    };
    writeln!(
        out,
        r#"<line class="threshold" x1="{x0}" y1="{ty:.1}" x2="{x1}" y2="{ty:.1}" stroke="{THRESHOLD}" stroke-width="1.5" stroke-dasharray="6 4"/>"#
    )?;
    writeln!(
        out,
        r#"<text x="{}" y="{:.1}" text-anchor="end" fill="{THRESHOLD}">{}</text>"#,
        x1 - 4.0,
        // Under the line when it runs along the top, else above it.
        if ty - y0 < 16.0 { ty + 14.0 } else { ty - 5.0 },
        escape(&threshold_label)
    )?;
    for (class, color, forwarded) in [
        ("received", RECEIVED, false),
        ("forwarded", FORWARDED, true),
    ] {
        let points: Vec<String> = report
            .rows
            .iter()
            .map(|r| {
                let tokens = if forwarded { r.forwarded } else { r.received };
                format!("{:.1},{:.1}", scale.x(r.step), scale.y(tokens))
            })
            .collect();
        writeln!(
            out,
            r#"<polyline class="{class}" points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
            points.join(" ")
        )?;
    }
    for r in report
        .rows
        .iter()
        .filter(|r| r.missed == Some(Missed::Failed))
    {
        let (x, y) = (scale.x(r.step), scale.y(r.forwarded));
        writeln!(
            out,
            r#"<path class="failed" d="M{:.1} {:.1} L{:.1} {:.1} M{:.1} {:.1} L{:.1} {:.1}" stroke="{FAILED}" stroke-width="2"><title>{}</title></path>"#,
            x - 4.0,
            y - 4.0,
            x + 4.0,
            y + 4.0,
            x - 4.0,
            y + 4.0,
            x + 4.0,
            y - 4.0,
            escape(&format!("step {}: compaction due but failed", r.step))
        )?;
    }
    // A compaction is marked where it first shapes the forwarded request: the step that made
    // it, or, for a summary made in the background, the first step that splices it.
    let mut marked = 0;
    for r in &report.rows {
        let how = match &r.event {
            Event::Compacted { num, trigger, .. } => Some((*num, trigger.label().to_string())),
            Event::Reused { num, .. } if *num > marked => {
                Some((*num, "made in the background".to_string()))
            }
            _ => None,
        };
        if let Some((num, how)) = how {
            marked = marked.max(num);
            writeln!(
                out,
                r#"<circle class="compaction" cx="{:.1}" cy="{:.1}" r="5" fill="{MARKER}" stroke="white"><title>{}</title></circle>"#,
                scale.x(r.step),
                scale.y(r.forwarded),
                escape(&format!(
                    "step {}: compaction #{num} ({how}), {} → {} tokens",
                    r.step, r.received, r.forwarded
                ))
            )?;
        }
    }
    writeln!(out, "</g>")
}

/// A legend entry's symbol.
#[derive(Clone, Copy)]
enum Symbol {
    Line,
    Dashed,
    Circle,
    Cross,
}

/// The legend, in one row under the title.
fn legend(out: &mut String) -> fmt::Result {
    writeln!(
        out,
        r#"<g class="legend" transform="translate({LEFT} 40)">"#
    )?;
    let entries = [
        (Symbol::Line, RECEIVED, "tokens received"),
        (Symbol::Line, FORWARDED, "tokens forwarded"),
        (Symbol::Circle, MARKER, "compaction"),
        (Symbol::Cross, FAILED, "failed compaction"),
        (Symbol::Dashed, THRESHOLD, "token threshold"),
    ];
    let mut x = 0.0;
    for (symbol, color, text) in entries {
        let (mid, end) = (x + 11.0, x + 22.0);
        match symbol {
            Symbol::Line => writeln!(
                out,
                r#"<line x1="{x}" y1="0" x2="{end}" y2="0" stroke="{color}" stroke-width="2"/>"#
            )?,
            Symbol::Dashed => writeln!(
                out,
                r#"<line x1="{x}" y1="0" x2="{end}" y2="0" stroke="{color}" stroke-width="1.5" stroke-dasharray="6 4"/>"#
            )?,
            Symbol::Circle => writeln!(out, r#"<circle cx="{mid}" cy="0" r="5" fill="{color}"/>"#)?,
            Symbol::Cross => writeln!(
                out,
                r#"<path d="M{} -4 L{} 4 M{} 4 L{} -4" stroke="{color}" stroke-width="2"/>"#,
                mid - 4.0,
                mid + 4.0,
                mid - 4.0,
                mid + 4.0
            )?,
        }
        writeln!(out, r#"<text x="{}" y="4">{text}</text>"#, x + 28.0)?;
        // About 6.2 px per character at 12 px, then a gap.
        x += 28.0 + 6.2 * text.len() as f64 + 16.0;
    }
    writeln!(out, "</g>")
}

/// The last component of a path.
fn file_name(path: &str) -> &str {
    path.rsplit(['/', '\\']).next().unwrap_or(path)
}

/// At most `max` characters, an ellipsis marking a cut.
fn clip(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_string();
    }
    let kept: String = text.chars().take(max.saturating_sub(1)).collect();
    format!("{kept}…")
}

/// A round step (1, 2 or 5 × a power of ten) dividing `max` into about `target` parts.
fn nice_step(max: f64, target: usize) -> f64 {
    let raw = max / target.max(1) as f64;
    if !raw.is_finite() || raw <= 0.0 {
        return 1.0;
    }
    let magnitude = 10f64.powf(raw.log10().floor());
    let normal = raw / magnitude;
    let nice = if normal <= 1.0 {
        1.0
    } else if normal <= 2.0 {
        2.0
    } else if normal <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * magnitude
}

/// Step numbers labelled on the x axis: the first and every multiple of a round step.
fn step_ticks(steps: usize) -> Vec<usize> {
    let every = (nice_step(steps as f64, 10).ceil() as usize).max(1);
    let mut ticks: Vec<usize> = (1..=steps).filter(|s| s % every == 0).collect();
    if steps >= 1 && ticks.first() != Some(&1) {
        ticks.insert(0, 1);
    }
    ticks
}

/// `950`, `2.5k`, `120k`, `1.2M`.
fn tokens_label(value: f64) -> String {
    let short = |v: f64, unit: &str| {
        let text = format!("{v:.1}");
        format!("{}{unit}", text.trim_end_matches(".0"))
    };
    if value >= 1e6 {
        short(value / 1e6, "M")
    } else if value >= 1e3 {
        short(value / 1e3, "k")
    } else {
        format!("{value:.0}")
    }
}

/// Text safe in XML content and attribute values; control characters XML 1.0 forbids become
/// U+FFFD.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\t' | '\n' | '\r' => out.push(c),
            c if c.is_control() => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compaction::{Limits, Trigger};
    use crate::replay::{Format, StepRow, SummarizerTokens};

    /// The chart's element names in document order, when it parses as XML.
    fn check_well_formed(doc: &str) -> Result<Vec<String>, String> {
        let doc = roxmltree::Document::parse(doc).map_err(|e| e.to_string())?;
        Ok(doc
            .descendants()
            .filter(|n| n.is_element())
            .map(|n| n.tag_name().name().to_string())
            .collect())
    }

    fn report(name: &str, compacted_at: &[usize], steps: usize) -> FileReport {
        report_with_failures(name, compacted_at, &[], steps)
    }

    fn report_with_failures(
        name: &str,
        compacted_at: &[usize],
        failed_at: &[usize],
        steps: usize,
    ) -> FileReport {
        let mut compactions = 0;
        let rows = (1..=steps)
            .map(|step| {
                let received = step * 700;
                let (event, forwarded) = if compacted_at.contains(&step) {
                    compactions += 1;
                    let event = Event::Compacted {
                        num: compactions as u32,
                        trigger: Trigger::Tokens,
                        forwarded_messages: 4,
                    };
                    (event, received / 3)
                } else {
                    (Event::Unchanged, received)
                };
                StepRow {
                    step,
                    messages: step * 2,
                    received,
                    forwarded,
                    compactions,
                    summarizer_calls: compactions,
                    event,
                    missed: failed_at.contains(&step).then_some(Missed::Failed),
                    background: false,
                    masked: 0,
                    prefix_stable: None,
                    cached: 0,
                    received_cached: 0,
                }
            })
            .collect();
        FileReport {
            name: name.into(),
            format: Format::Transcript,
            dialect: "chat_completions".into(),
            model: Some("gpt-4o".into()),
            summarizer: "extractive".into(),
            strategy: crate::config::Strategy::Summarize,
            price: None,
            summarizer_tokens: SummarizerTokens::default(),
            summarizer_inside: false,
            summarizer_price: None,
            limits: Limits {
                context_window: 8_000,
                summarizer_window: 8_000,
                reserved_output: 0,
                token_threshold: 6_800,
                wait_threshold: 6_800,
                max_messages: 80,
                opening_budget: 2_266,
            },
            rows,
            probes: crate::replay::ProbeScore::default(),
        }
    }

    /// Summaries made in the background are spliced (`Reused`) at the step after they were
    /// started: each new one gets its marker there, as the count in the panel says.
    #[test]
    fn summaries_made_in_the_background_are_marked_where_first_spliced() {
        let mut r = report("background.json", &[3], 12);
        let mut compactions = 1;
        for row in r.rows.iter_mut().skip(5) {
            let num = if row.step >= 9 { 3 } else { 2 };
            if num > compactions {
                compactions = num;
            }
            row.event = Event::Reused {
                num,
                forwarded_messages: 4,
            };
            row.compactions = compactions as usize;
            row.summarizer_calls = compactions as usize;
            row.forwarded = row.received / 3;
        }
        assert_eq!(r.compactions(), 3);
        let chart = render(&[r]);
        check_well_formed(&chart).expect("well formed");
        assert_eq!(chart.matches(r#"class="compaction""#).count(), 3, "{chart}");
        assert!(chart.contains("step 6: compaction #2 (made in the background)"));
        assert!(chart.contains("step 9: compaction #3 (made in the background)"));
        assert!(chart.contains(">summarize, gpt-4o, extractive: 3 compactions"));
    }

    /// However long the file name, the title ends before the figures begin.
    #[test]
    fn a_long_file_name_never_runs_into_the_figures() {
        let long = format!("{}.json", "a-very-long-recorded-transcript-name".repeat(4));
        let chart = render(&[report(&long, &[3, 7], 10)]);
        let text_of = |class: &str| -> String {
            let doc = roxmltree::Document::parse(&chart).expect("well formed");
            let node = doc
                .descendants()
                .find(|n| n.attribute("class") == Some(class))
                .unwrap_or_else(|| panic!("no {class}"));
            node.children()
                .filter(|c| c.is_text())
                .filter_map(|c| c.text())
                .collect()
        };
        let (title, figures) = (text_of("title"), text_of("figures"));
        assert!(title.ends_with('…'), "clipped: {title}");
        let used = TITLE_CHAR * title.chars().count() as f64
            + FIGURES_CHAR * figures.chars().count() as f64;
        assert!(used <= WIDTH - LEFT - RIGHT, "{title} | {figures}");
        assert!(
            chart.contains(&format!("<title>{long}</title>")),
            "full name in the tooltip"
        );
    }

    #[test]
    fn the_chart_is_well_formed_with_one_marker_per_compaction() {
        let reports = [
            report_with_failures(
                r#"<weird> & "quoted" 'name'.json"#,
                &[4, 9, 13],
                &[6, 7],
                15,
            ),
            report("one-step.json", &[], 1),
            report("empty.json", &[], 0),
        ];
        let chart = render(&reports);
        let elements = check_well_formed(&chart).unwrap_or_else(|e| panic!("{e}\n{chart}"));
        assert_eq!(elements[0], "svg");
        assert_eq!(
            elements.iter().filter(|e| *e == "circle").count(),
            3 + 3,
            "a legend circle per panel and a marker per compaction"
        );
        assert_eq!(chart.matches(r#"class="compaction""#).count(), 3);
        assert_eq!(chart.matches(r#"class="failed""#).count(), 2);
        assert_eq!(chart.matches(r#"class="panel""#).count(), 3);
        assert_eq!(chart.matches(r#"class="threshold""#).count(), 3);
        assert_eq!(chart.matches(r#"class="received""#).count(), 3);
        assert_eq!(chart.matches(r#"class="forwarded""#).count(), 3);
        assert!(chart.contains("&lt;weird&gt; &amp; &quot;quoted&quot; &apos;name&apos;.json"));
        assert!(!chart.contains("NaN") && !chart.contains("inf"), "{chart}");
        // The panels stack: the second starts one panel height down.
        assert!(chart.contains(&format!(r#"transform="translate(0 {PANEL})""#)));
    }

    #[test]
    fn the_y_axis_reaches_the_threshold_and_points_stay_inside() {
        let r = report("t.json", &[3], 5);
        let chart = render(std::slice::from_ref(&r));
        // Peak 3,500 tokens, threshold 6,800: the axis is labelled up to 8k.
        assert!(chart.contains(">8k</text>"), "{chart}");
        assert!(chart.contains("token threshold 6800"));
        let points = chart
            .split(r#"class="received" points=""#)
            .nth(1)
            .and_then(|s| s.split('"').next())
            .expect("received points");
        for point in points.split(' ') {
            let (x, y) = point.split_once(',').expect("x,y");
            let (x, y): (f64, f64) = (x.parse().expect("x"), y.parse().expect("y"));
            assert!((LEFT..=WIDTH - RIGHT).contains(&x), "{point}");
            assert!((TOP..=PANEL - BOTTOM).contains(&y), "{point}");
        }
    }

    #[test]
    fn a_threshold_far_above_the_conversation_runs_along_the_top_edge() {
        let mut r = report("t.json", &[3], 5);
        r.limits.token_threshold = 108_800;
        let chart = render(std::slice::from_ref(&r));
        check_well_formed(&chart).unwrap_or_else(|e| panic!("{e}\n{chart}"));
        // Peak 3,500 tokens: the axis stops at 4k, the threshold is labelled off scale.
        assert!(chart.contains(">4k</text>"), "{chart}");
        assert!(!chart.contains(">100k</text>"), "{chart}");
        assert!(chart.contains("token threshold 108800 (off scale, above)"));
        assert!(
            chart.contains(&format!(r#"class="threshold" x1="{LEFT}" y1="{TOP:.1}""#)),
            "{chart}"
        );
    }

    #[test]
    fn labels_and_ticks_are_round() {
        assert_eq!(tokens_label(0.0), "0");
        assert_eq!(tokens_label(950.0), "950");
        assert_eq!(tokens_label(2500.0), "2.5k");
        assert_eq!(tokens_label(120_000.0), "120k");
        assert_eq!(tokens_label(1_200_000.0), "1.2M");
        assert_eq!(nice_step(108_800.0, 5), 50_000.0);
        assert_eq!(step_ticks(5), vec![1, 2, 3, 4, 5]);
        assert_eq!(step_ticks(43), vec![1, 5, 10, 15, 20, 25, 30, 35, 40]);
        assert_eq!(step_ticks(0), Vec::<usize>::new());
        assert_eq!(escape("a\u{1}b"), "a\u{fffd}b");
        assert_eq!(file_name("tests/fixtures/a.json"), "a.json");
        assert_eq!(clip("abcdef", 4), "abc…");
        assert_eq!(clip("abc", 4), "abc");
    }
}
