//! `compaction.strategy = "mask"` over real sockets: an Anthropic Messages conversation with
//! signed thinking and parallel tool results reaches the provider with its old tool outputs
//! replaced by placeholders and every other byte as sent, the response says how much smaller
//! it was, the next request of the conversation forwards the same prefix, and the masking
//! metrics count it.

mod support;

use bytes::Bytes;
use serde_json::{json, Value};
use support::{upstream_toml, MockUpstream, Reply, TestClient, TestProxy};

/// A task, then `steps` assistant turns (signed thinking, two parallel tool calls) each
/// answered by a user message of two `tool_result` blocks of ~800 characters.
fn conversation(steps: usize) -> Vec<Value> {
    let mut m = vec![json!({"role": "user", "content": "Find why the build fails."})];
    for i in 0..steps {
        m.push(json!({"role": "assistant", "content": [
            {"type": "thinking", "thinking": format!("step {i}"), "signature": format!("SIG{i}+/=")},
            {"type": "tool_use", "id": format!("toolu_{i}a"), "name": "Read", "input": {"path": format!("a{i}.rs")}},
            {"type": "tool_use", "id": format!("toolu_{i}b"), "name": "Bash", "input": {"command": "cargo build"}}
        ]}));
        let output = |tag: &str| {
            let mut out = format!("{tag} {i} first line\n");
            while out.len() < 800 {
                out.push_str("compiling crate with a long line of build output\n");
            }
            out.push_str(&format!("{tag} {i} last line"));
            out
        };
        m.push(json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": format!("toolu_{i}b"), "content": output("bash")},
            {"type": "tool_result", "tool_use_id": format!("toolu_{i}a"), "content": [{"type": "text", "text": output("read")}], "cache_control": {"type": "ephemeral"}}
        ]}));
    }
    m
}

fn request(messages: &[Value]) -> Bytes {
    Bytes::from(
        json!({"model": "claude-sonnet-4-5", "max_tokens": 1024, "system": "You are a build doctor.",
               "thinking": {"type": "enabled", "budget_tokens": 1024}, "messages": messages})
        .to_string(),
    )
}

fn reply() -> Reply {
    Reply::json(
        200,
        &json!({"type": "message", "role": "assistant", "content": [{"type": "text", "text": "ok"}],
                "usage": {"input_tokens": 10, "output_tokens": 1}}),
    )
}

fn messages_of(body: &[u8]) -> Vec<Value> {
    let v: Value = serde_json::from_slice(body).expect("JSON body");
    v["messages"].as_array().expect("messages").clone()
}

#[tokio::test]
async fn old_tool_results_reach_the_provider_masked_and_the_prefix_holds() {
    let mock = MockUpstream::start().await;
    let toml = format!(
        "{}[compaction]\nstrategy = \"mask\"\nkeep_recent_outputs = 2\nmask_block = 4\n",
        upstream_toml(&mock.url())
    );
    let proxy = TestProxy::start(&toml).await;
    let client = TestClient::http1();
    let url = proxy.url("/v1/messages");
    let headers = [
        ("content-type", "application/json"),
        ("x-api-key", "sk-ant-test"),
    ];

    // 5 steps: 10 outputs, 8 old, masked in blocks of 4: the first 8.
    let messages = conversation(5);
    mock.push(reply());
    let ex = client
        .exchange("POST", &url, &headers, request(&messages))
        .await;
    assert_eq!(ex.status, 200);
    let first = mock.last_request();
    let sent = messages_of(&first.body);
    assert_eq!(sent.len(), messages.len());
    let mut masked = 0;
    for (i, (got, original)) in sent.iter().zip(&messages).enumerate() {
        if original["role"] == "assistant" || i == 0 {
            assert_eq!(got, original, "message {i} forwarded as sent");
            continue;
        }
        for (b, (g, o)) in got["content"]
            .as_array()
            .expect("blocks")
            .iter()
            .zip(original["content"].as_array().expect("blocks"))
            .enumerate()
        {
            assert_eq!(g["tool_use_id"], o["tool_use_id"]);
            assert_eq!(g["cache_control"], o["cache_control"]);
            if i < 9 {
                masked += 1;
                let text = g["content"].as_str().expect("a placeholder");
                let step = (i - 2) / 2;
                let (tool, tag, id) = if b == 0 {
                    ("Bash", "bash", format!("toolu_{step}b"))
                } else {
                    ("Read", "read", format!("toolu_{step}a"))
                };
                assert!(
                    text.starts_with(&format!("[output masked by compactor: {tool} call {id}, ")),
                    "{text}"
                );
                assert!(text.contains(&format!("first: {tag} {step} first line")));
                assert!(text.ends_with(&format!("last: {tag} {step} last line")));
            } else {
                assert_eq!(g, o, "recent output {i}/{b} forwarded as sent");
            }
        }
    }
    assert_eq!(masked, 8);
    let text = String::from_utf8(first.body.to_vec()).expect("utf-8");
    for i in 0..5 {
        assert!(
            text.contains(&format!("\"signature\":\"SIG{i}+/=\"")),
            "signature {i}"
        );
    }
    assert_eq!(ex.header("x-compactor-compacted"), Some("false"));
    let before: usize = ex
        .header("x-compactor-tokens-before")
        .and_then(|v| v.parse().ok())
        .expect("tokens before");
    let after: usize = ex
        .header("x-compactor-tokens-after")
        .and_then(|v| v.parse().ok())
        .expect("tokens after");
    assert!(after * 2 < before, "{after} of {before}");

    // The next step adds two outputs: still 8 masked, so the previous request's bytes lead
    // the new one.
    let longer = conversation(6);
    mock.push(reply());
    let ex = client
        .exchange("POST", &url, &headers, request(&longer))
        .await;
    assert_eq!(ex.status, 200);
    let second = mock.last_request();
    assert!(
        compactor::replay::prefix_stable(
            compactor::dialect::DialectKind::Messages,
            &first.body,
            &second.body
        ),
        "the prefix changed between mask steps"
    );
    // Two steps later 12 outputs: the next block of 4 is masked, and the prefix moves once.
    let step = conversation(7);
    mock.push(reply());
    let ex = client
        .exchange("POST", &url, &headers, request(&step))
        .await;
    assert_eq!(ex.status, 200);
    let third = mock.last_request();
    assert!(!compactor::replay::prefix_stable(
        compactor::dialect::DialectKind::Messages,
        &second.body,
        &third.body
    ));
    let masked_now = String::from_utf8_lossy(&third.body)
        .matches("[output masked by compactor: ")
        .count();
    assert_eq!(masked_now, 12);

    assert_eq!(
        proxy
            .metric(
                "compactor_masked_outputs_total",
                &[("dialect", "messages"), ("strategy", "mask")]
            )
            .await,
        Some(28.0)
    );
    assert_eq!(
        proxy
            .metric(
                "compactor_request_tokens_count",
                &[("dialect", "messages"), ("stage", "masked")]
            )
            .await,
        Some(3.0)
    );
    assert_eq!(
        proxy
            .metric("compactor_compaction_strategy", &[("strategy", "mask")])
            .await,
        Some(1.0)
    );
    proxy.shutdown().await;
}
