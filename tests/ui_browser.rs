//! The session inspector page (`/ui`) in a real headless browser: Debian's `chromium` driven
//! through `chromedriver` (W3C WebDriver over HTTP, from this test). A conversation is
//! compacted through the proxy; the page, opened with the admin token, lists the session,
//! draws one point per request whose figures are the admin API's, marks the compaction, and
//! logs no console error. `COMPACTOR_UI_SCREENSHOT=path.png` saves what it shows.

mod support;

use std::process::Stdio;

use bytes::Bytes;
use serde_json::{json, Value};
use support::{upstream_toml, Exchange, MockUpstream, Reply, TestClient, TestProxy};

const TOKEN: &str = "ui-admin-token";
const INSTALL: &str = "scripts/chromium-install";

async fn call(method: &str, url: &str, body: &Value) -> Value {
    let body = if body.is_null() {
        Bytes::new()
    } else {
        Bytes::from(body.to_string())
    };
    let got: Exchange = TestClient::http1()
        .exchange(method, url, &[("content-type", "application/json")], body)
        .await;
    serde_json::from_slice(&got.body)
        .unwrap_or_else(|e| panic!("{method} {url}: not JSON ({e}): {:?}", got.body))
}

/// A running chromedriver, killed on drop.
struct Driver {
    _child: tokio::process::Child,
    url: String,
}

impl Driver {
    async fn start() -> Driver {
        let port = support::closed_port();
        let child = tokio::process::Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("chromedriver is required ({e}): run `{INSTALL}`"));
        let url = format!("http://127.0.0.1:{port}");
        // Ready when its status endpoint says so.
        support::within("chromedriver to start", async {
            loop {
                let request = http::Request::get(format!("{url}/status"))
                    .body(support::empty_body())
                    .expect("request");
                if let Ok(response) = TestClient::http1().try_send(request).await {
                    let body = support::body_bytes(response).await;
                    if String::from_utf8_lossy(&body).contains("\"ready\":true") {
                        break;
                    }
                }
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        })
        .await;
        Driver { _child: child, url }
    }
}

#[tokio::test]
async fn the_session_page_shows_what_the_admin_api_says_with_no_console_error() {
    let mock = MockUpstream::start().await;
    mock.set_handler(|_| {
        Reply::json(
            200,
            &json!({"id": "c", "object": "chat.completion",
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": "ok"}}]}),
        )
    });
    let proxy = TestProxy::start(&format!(
        "{}[admin]\ntoken = \"{TOKEN}\"\n[compaction]\nmax_messages = 10\nmin_preserve_tokens = 20\n\
         max_preserve_tokens = 200\n[summarizer]\nbackend = \"extractive\"\n",
        upstream_toml(&mock.url())
    ))
    .await;
    // One conversation, three requests: the second compacts it, the third splices the summary.
    let mut messages = vec![json!({"role": "system", "content": "be brief"})];
    let mut session = String::new();
    for n in [5, 13, 15] {
        while messages.len() < n {
            let role = if messages.len() % 2 == 1 {
                "user"
            } else {
                "assistant"
            };
            let turn = messages.len();
            messages.push(
                json!({"role": role, "content": format!("turn {turn}: {}", "words ".repeat(300))}),
            );
        }
        let got = TestClient::http1()
            .exchange(
                "POST",
                &proxy.url("/v1/chat/completions"),
                &[("content-type", "application/json")],
                Bytes::from(json!({"model": "gpt-4o", "messages": messages}).to_string()),
            )
            .await;
        assert_eq!(got.status, 200);
        session = got
            .header("x-compactor-session")
            .expect("session")
            .to_string();
    }

    // Without the token the page is refused like the rest of the admin API.
    let refused = TestClient::http1()
        .exchange("GET", &proxy.admin_url("/ui"), &[], Bytes::new())
        .await;
    assert_eq!(refused.status, 401);

    let driver = Driver::start().await;
    let created = call(
        "POST",
        &format!("{}/session", driver.url),
        &json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                                             "--disable-dev-shm-usage", "--window-size=1200,800"]},
            "goog:loggingPrefs": {"browser": "ALL"}
        }}}),
    )
    .await;
    let id = created["value"]["sessionId"]
        .as_str()
        .unwrap_or_else(|| panic!("no browser session: {created}"))
        .to_string();
    let browser = format!("{}/session/{id}", driver.url);
    let page = format!("{}?token={TOKEN}#session={session}", proxy.admin_url("/ui"));
    call("POST", &format!("{browser}/url"), &json!({"url": page})).await;

    // The page lists the session and draws a point per request once its data came in.
    let script = "return {
        listed: Array.from(document.querySelectorAll('#sessions a.session')).map(a => a.dataset.id),
        points: Array.from(document.querySelectorAll('#chart circle.point'))
            .map(c => [Number(c.dataset.received), Number(c.dataset.forwarded), c.dataset.done]),
        compactions: document.querySelectorAll('#chart .compaction').length,
        summary: document.getElementById('summary').textContent,
    };";
    let shown = support::within("the page to draw the session", async {
        loop {
            let v = call(
                "POST",
                &format!("{browser}/execute/sync"),
                &json!({"script": script, "args": []}),
            )
            .await;
            if v["value"]["points"]
                .as_array()
                .is_some_and(|p| p.len() == 3)
            {
                break v["value"].clone();
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(
        shown["listed"]
            .as_array()
            .is_some_and(|l| l.iter().any(|s| s == &json!(session))),
        "{shown}"
    );
    let api: Value = serde_json::from_slice(
        &TestClient::http1()
            .exchange(
                "GET",
                &proxy.admin_url(&format!("/session/{session}/requests")),
                &[("authorization", &format!("Bearer {TOKEN}"))],
                Bytes::new(),
            )
            .await
            .body,
    )
    .expect("JSON");
    let expected: Vec<Value> = api["points"]
        .as_array()
        .expect("points")
        .iter()
        .map(|p| json!([p["received"], p["forwarded"], p["done"]]))
        .collect();
    assert_eq!(
        shown["points"],
        json!(expected),
        "the chart is the admin API's"
    );
    let compacted = expected.iter().filter(|p| p[2] == "compacted").count();
    assert!(compacted >= 1, "the conversation compacted: {api}");
    assert_eq!(
        shown["compactions"], compacted,
        "a mark per compaction: {shown}"
    );
    assert!(
        shown["summary"]
            .as_str()
            .is_some_and(|s| !s.is_empty() && s != "(no summary yet)"),
        "{shown}"
    );

    if let Ok(path) = std::env::var("COMPACTOR_UI_SCREENSHOT") {
        use base64::Engine as _;
        let shot = call("GET", &format!("{browser}/screenshot"), &Value::Null).await;
        let png = base64::engine::general_purpose::STANDARD
            .decode(shot["value"].as_str().expect("base64"))
            .expect("PNG");
        std::fs::write(path, png).expect("write the screenshot");
    }
    let logs = call(
        "POST",
        &format!("{browser}/se/log"),
        &json!({"type": "browser"}),
    )
    .await;
    let errors: Vec<&Value> = logs["value"]
        .as_array()
        .map(|l| l.iter().filter(|e| e["level"] == "SEVERE").collect())
        .unwrap_or_default();
    assert!(errors.is_empty(), "console errors: {errors:?}");
    call("DELETE", &browser, &Value::Null).await;
}
