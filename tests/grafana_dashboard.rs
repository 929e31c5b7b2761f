//! `config/grafana/compactor.json` is a valid Grafana dashboard whose every query names metrics
//! that a real compactor exports: the proxy runs on real sockets, a little traffic goes
//! through it (a pass-through call, a compacted chat request, a failing upstream), and its
//! `/metrics` scrape must hold each metric family the dashboard's `targets[].expr` mention; and
//! every metric selector keeps to the `$job` and `$instance` picked.

mod support;

use std::collections::{BTreeMap, BTreeSet, HashSet};

use http::StatusCode;
use regex::Regex;
use serde_json::{json, Value};
use support::{
    body_bytes, refused_port, upstream_toml, MockUpstream, Reply, TestClient, TestProxy,
};

const DASHBOARD: &str = include_str!("../config/grafana/compactor.json");
const DATASOURCE: &str = "${DS_PROMETHEUS}";

fn dashboard() -> Value {
    serde_json::from_str(DASHBOARD).expect("config/grafana/compactor.json is not valid JSON")
}

/// Every panel, rows' nested panels included.
fn panels(dashboard: &Value) -> Vec<&Value> {
    fn walk<'a>(list: &'a Value, out: &mut Vec<&'a Value>) {
        for p in list.as_array().into_iter().flatten() {
            out.push(p);
            walk(&p["panels"], out);
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

/// Every `targets[].expr` of every panel.
fn exprs(dashboard: &Value) -> Vec<String> {
    panels(dashboard)
        .into_iter()
        .flat_map(|p| p["targets"].as_array().into_iter().flatten())
        .filter_map(|t| t["expr"].as_str().map(str::to_owned))
        .collect()
}

/// Metric names in the queries, as written (`…_bucket` and friends kept).
fn series_names(dashboard: &Value) -> BTreeSet<String> {
    let re = Regex::new(r"compactor_[a-z_]+").expect("regex");
    exprs(dashboard)
        .iter()
        .flat_map(|e| {
            re.find_iter(e)
                .map(|m| m.as_str().to_owned())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The metric family a series name belongs to.
fn family(series: &str) -> &str {
    ["_bucket", "_sum", "_count"]
        .iter()
        .find_map(|suffix| series.strip_suffix(suffix))
        .unwrap_or(series)
}

#[test]
fn dashboard_is_a_grafana_dashboard() {
    let d = dashboard();
    assert_eq!(d["title"], "compactor");
    assert!(d["uid"].as_str().is_some_and(|u| !u.is_empty()));
    let schema = d["schemaVersion"].as_u64().expect("schemaVersion");
    assert!((36..=41).contains(&schema), "schemaVersion {schema}");
    let inputs = d["__inputs"].as_array().expect("__inputs");
    assert!(
        inputs
            .iter()
            .any(|i| i["name"] == "DS_PROMETHEUS" && i["pluginId"] == "prometheus"),
        "no DS_PROMETHEUS input: {inputs:?}"
    );

    let all = panels(&d);
    assert!(all.len() >= 10, "only {} panels", all.len());
    let mut ids = HashSet::new();
    for p in &all {
        let id = p["id"].as_u64().expect("panel id");
        assert!(ids.insert(id), "duplicate panel id {id}");
        let title = p["title"].as_str().expect("panel title");
        let grid = &p["gridPos"];
        let (x, w) = (grid["x"].as_u64(), grid["w"].as_u64());
        let (Some(x), Some(w)) = (x, w) else {
            panic!("{title}: gridPos {grid}");
        };
        assert!(x + w <= 24, "{title}: wider than the grid");
        assert!(grid["h"].as_u64().is_some() && grid["y"].as_u64().is_some());
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"], DATASOURCE, "{title}");
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{title}: no targets");
        let mut refs = HashSet::new();
        for t in targets {
            assert!(refs.insert(t["refId"].as_str().expect("refId")), "{title}");
            assert_eq!(t["datasource"]["uid"], DATASOURCE, "{title}");
            let expr = t["expr"].as_str().expect("expr");
            assert!(expr.contains("compactor_"), "{title}: {expr}");
            // Balanced brackets: a cheap guard against hand-edit slips.
            for (open, close) in [('(', ')'), ('{', '}'), ('[', ']')] {
                assert_eq!(
                    expr.matches(open).count(),
                    expr.matches(close).count(),
                    "{title}: unbalanced {open}{close} in {expr}"
                );
            }
        }
    }
    for v in d["templating"]["list"].as_array().expect("templating") {
        if v["type"] == "query" {
            assert_eq!(v["datasource"]["uid"], DATASOURCE, "variable {}", v["name"]);
        }
    }
}

/// Every metric selector of every query keeps to the `$job` and `$instance` the viewer picked:
/// a panel without them mixes in every other deployment the Prometheus scrapes.
#[test]
fn every_query_filters_by_job_and_instance() {
    let selector = Regex::new(r"compactor_[a-z_]+(\{[^}]*\})?").expect("regex");
    let mut unfiltered = Vec::new();
    for p in panels(&dashboard()) {
        let title = p["title"].as_str().unwrap_or("?");
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().unwrap_or_default();
            for found in selector.captures_iter(expr) {
                let matchers: Vec<&str> = found
                    .get(1)
                    .map(|m| m.as_str().trim_matches(['{', '}']))
                    .unwrap_or_default()
                    .split(',')
                    .map(str::trim)
                    .collect();
                for wanted in [r#"job=~"$job""#, r#"instance=~"$instance""#] {
                    if !matchers.contains(&wanted) {
                        unfiltered.push(format!("{title}: `{}` lacks {wanted}", &found[0]));
                    }
                }
            }
        }
    }
    assert!(unfiltered.is_empty(), "{}", unfiltered.join("\n"));
}

#[test]
fn dashboard_covers_the_issue_panels() {
    let families: BTreeSet<String> = series_names(&dashboard())
        .iter()
        .map(|s| family(s).to_owned())
        .collect();
    for wanted in [
        "compactor_requests_total",
        "compactor_overhead_seconds",
        "compactor_compactions_total",
        "compactor_request_tokens",
        "compactor_tokens_saved_total",
        "compactor_context_utilization_ratio",
        "compactor_summarizer_duration_seconds",
        "compactor_summarizer_requests_total",
        "compactor_sessions",
        "compactor_store_evictions_total",
        "compactor_upstream_usage_tokens_total",
        "compactor_estimate_error_ratio",
        "compactor_masked_outputs_total",
        "compactor_mask_failures_total",
        "compactor_compaction_strategy",
        "compactor_cohort_requests_total",
        "compactor_cohort_conversations_total",
        "compactor_cohort_tokens_total",
        "compactor_cohort_cost_usd_total",
        "compactor_cohort_context_errors_total",
        "compactor_cohort_conversation_tokens",
    ] {
        assert!(families.contains(wanted), "no panel queries {wanted}");
    }
    let text = exprs(&dashboard()).join("\n");
    assert!(
        text.contains("stage=\"masked\""),
        "no panel reads the masked stage of compactor_request_tokens"
    );
    assert!(text.contains(
        "histogram_quantile(0.99, sum by (le, route) (rate(compactor_overhead_seconds_bucket"
    ));
    assert!(text.contains(
        "histogram_quantile(0.5, sum by (le, route) (rate(compactor_overhead_seconds_bucket"
    ));
    assert!(text.contains(
        "histogram_quantile(0.9, sum by (le, cohort) (rate(compactor_cohort_conversation_tokens_bucket"
    ));
    assert!(
        text.contains("cohort=\"shadow\",stage=\"forwarded\"")
            && text.contains("cohort=\"shadow\",stage=\"received\""),
        "no panel compares the shadow cohort's forwarded and received tokens"
    );
}

/// A chat conversation long enough for `max_messages = 6`, whose long assistant turns leave
/// the local summarizer plenty to shorten.
fn long_chat() -> Value {
    let mut messages = vec![json!({"role": "system", "content": "You are a careful assistant."})];
    for i in 0..12 {
        let content = if i % 2 == 0 {
            format!("turn {i}: what does src/main.rs do?")
        } else {
            format!(
                "turn {i}: {}",
                "It parses the flags, loads the config and runs. ".repeat(40)
            )
        };
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        messages.push(json!({"role": role, "content": content}));
    }
    json!({"model": "gpt-4o-mini", "messages": messages})
}

/// `# TYPE` of every family in a scrape.
fn types(scrape: &str) -> BTreeMap<String, String> {
    scrape
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| {
            let (name, kind) = l.split_once(' ')?;
            Some((name.to_owned(), kind.trim().to_owned()))
        })
        .collect()
}

#[tokio::test]
async fn every_dashboard_metric_is_in_a_real_scrape() {
    let mock = MockUpstream::start().await;
    let refused = refused_port();
    let dead = refused.port();
    let toml = format!(
        "{}[[routes]]\nprefix = \"/dead\"\nbase_url = \"http://127.0.0.1:{dead}\"\n\
         [summarizer]\nbackend = \"extractive\"\n\
         [compaction]\nmax_messages = 6\nmin_preserve_tokens = 20\nmax_preserve_tokens = 60\n",
        upstream_toml(&mock.url())
    );
    let proxy = TestProxy::start(&toml).await;
    let client = TestClient::http1();

    // A pass-through call.
    mock.push(Reply::json(200, &json!({"object": "list", "data": []})));
    let response = client.get(&proxy.url("/v1/models")).await;
    assert_eq!(response.status(), StatusCode::OK);
    body_bytes(response).await;

    // A chat call that gets compacted by the local summarizer; the upstream reports usage.
    mock.push(Reply::json(
        200,
        &json!({
            "id": "chatcmpl-1", "object": "chat.completion", "model": "gpt-4o-mini",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 400, "completion_tokens": 2, "total_tokens": 402,
                      "prompt_tokens_details": {"cached_tokens": 0}}
        }),
    ));
    let response = client
        .post_json(&proxy.url("/v1/chat/completions"), &long_chat())
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response
            .headers()
            .get("x-compactor-compacted")
            .and_then(|v| v.to_str().ok()),
        Some("true"),
        "the chat request was meant to be compacted"
    );
    body_bytes(response).await;

    // An upstream that refuses connections.
    let response = client.get(&proxy.url("/dead/v1/models")).await;
    assert!(response.status().is_server_error(), "{}", response.status());
    body_bytes(response).await;

    let scrape = proxy.metrics().await;
    let types = types(&scrape);
    let series = series_names(&dashboard());
    assert!(!series.is_empty());
    let mut missing = Vec::new();
    for s in &series {
        let fam = family(s);
        let help = format!("# HELP {fam} ");
        let Some(kind) = types.get(fam) else {
            missing.push(format!("{s}: no `# TYPE {fam}` in the scrape"));
            continue;
        };
        if !scrape.lines().any(|l| l.starts_with(&help)) {
            missing.push(format!("{s}: no `{help}` line"));
        }
        let sampled = scrape.lines().any(|l| {
            l.strip_prefix(s.as_str())
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        });
        if !sampled {
            missing.push(format!("{s}: no sample line"));
        }
        if s != fam && kind != "histogram" {
            missing.push(format!("{s}: {fam} is a {kind}, not a histogram"));
        }
        if fam.ends_with("_total") && kind != "counter" {
            missing.push(format!("{fam} is a {kind}, not a counter"));
        }
    }
    assert!(
        missing.is_empty(),
        "dashboard queries metrics the proxy does not export:\n{}\n\nscrape:\n{scrape}",
        missing.join("\n")
    );

    // The traffic reached the families that only appear once touched.
    for (name, labels) in [
        (
            "compactor_compactions_total",
            vec![("trigger", "messages"), ("outcome", "compacted")],
        ),
        (
            "compactor_summarizer_requests_total",
            vec![("backend", "extractive"), ("outcome", "ok")],
        ),
        ("compactor_upstream_errors_total", vec![("kind", "connect")]),
    ] {
        assert_eq!(
            support::metric_value(&scrape, name, &labels),
            Some(1.0),
            "{name}{labels:?}"
        );
    }
    proxy.shutdown().await;
}
