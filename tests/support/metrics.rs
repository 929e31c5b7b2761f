//! Reading samples out of the Prometheus text exposition format.

use std::collections::BTreeMap;

/// One parsed sample line: `(name, labels, value)`; `None` for comments and blank lines.
pub fn parse_sample_line(line: &str) -> Option<(String, BTreeMap<String, String>, f64)> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let (name, labels, rest) = match line.find('{') {
        Some(open) if open < line.find(' ').unwrap_or(line.len()) => {
            let name = &line[..open];
            let (labels, after) = parse_labels(&line[open + 1..])?;
            (name, labels, after)
        }
        _ => {
            let space = line.find(' ')?;
            (&line[..space], BTreeMap::new(), &line[space..])
        }
    };
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some((name.to_owned(), labels, value))
}

/// Parses `k="v",k2="v2"}` (after the opening brace); returns the labels and the text after `}`.
fn parse_labels(s: &str) -> Option<(BTreeMap<String, String>, &str)> {
    let mut labels = BTreeMap::new();
    let mut rest = s;
    loop {
        rest = rest.trim_start_matches([',', ' ']);
        if let Some(after) = rest.strip_prefix('}') {
            return Some((labels, after));
        }
        let eq = rest.find('=')?;
        let key = rest[..eq].trim().to_owned();
        rest = rest[eq + 1..].strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '\\' => {
                    let (_, escaped) = chars.next()?;
                    value.push(match escaped {
                        'n' => '\n',
                        other => other,
                    });
                }
                '"' => break i,
                c => value.push(c),
            }
        };
        labels.insert(key, value);
        rest = &rest[end + 1..];
    }
}

/// The value of the sample named `name` whose label set is exactly `labels`.
pub fn metric_value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let wanted: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    text.lines()
        .filter_map(parse_sample_line)
        .find(|(n, l, _)| n == name && *l == wanted)
        .map(|(_, _, v)| v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_labelled_and_bare_samples() {
        let text = "# HELP x y\n\
                    compactor_requests_total{method=\"GET\",route=\"other\",status_class=\"2xx\"} 5\n\
                    compactor_in_flight_requests 0\n";
        assert_eq!(
            metric_value(
                text,
                "compactor_requests_total",
                &[
                    ("route", "other"),
                    ("method", "GET"),
                    ("status_class", "2xx")
                ]
            ),
            Some(5.0)
        );
        assert_eq!(
            metric_value(text, "compactor_in_flight_requests", &[]),
            Some(0.0)
        );
        assert_eq!(metric_value(text, "compactor_requests_total", &[]), None);
    }
}
