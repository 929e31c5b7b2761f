//! Side-by-side load bench: the same Chat Completions requests sent, in one run, to
//!
//! - **direct**: the fake provider itself;
//! - **nginx**: nginx as a reverse proxy in front of it (the reference for what a proxy costs);
//! - **pass-through**: the `compactor` binary with `[compaction] enabled = false`;
//! - **compactor**: the same binary with compaction enabled but never due (every request is
//!   inspected, none is rewritten), extractive summarizer;
//! - **litellm**: LiteLLM's proxy, when a `litellm` executable is on `PATH`.
//!
//! Workloads: a 1 KB request and a 200 KB one (769 messages), and a streamed one (a small
//! `"stream": true` request the provider answers with a 500-event Chat Completions SSE stream,
//! [`STREAM_EVENTS`]: a `role` chunk, content chunks, the finish with `usage`, `[DONE]`), each at
//! concurrency 1 and 32. compactor holds a streamed chat answer until its first content event
//! (`src/proxy/stream_hold.rs`), so the streamed workload also measures the time to the first
//! response byte at c=1 (an in-process client on a kept-alive connection), and its req/s
//! times the events per answer gives events/s.
//! Rounds are interleaved (every round runs every target once per cell, in a rotated order) so
//! that the noise of a shared machine lands on all targets alike; the report gives medians of
//! the rounds, p50 latency, the p50 added over direct, req/s and req/s ratios, each target's CPU
//! time per request (user space and kernel, from `/proc`), then checks the overhead goals
//! (printed as met / not met, never failing the run).
//!
//! Run: `cargo bench --bench load`. `LOAD_SECS` (default 3) sets the seconds per measurement,
//! `LOAD_ROUNDS` (default 3) the rounds; the default run takes about 4 minutes.
//! `LOAD_WORKLOADS` picks a subset by name, comma-separated: `1kb`, `200kb`, `200kb-new`,
//! `4mb-new`, `4mb-tail`, `stream` (default all); the goals of workloads left out are not
//! checked. E.g.
//! `LOAD_WORKLOADS=stream LOAD_ROUNDS=5 cargo bench --bench load`. `LOAD_BASELINE`, the path
//! of another compactor binary (the build before a change), adds it as a target of its own,
//! `baseline`, configured as `compactor`: before and after in one run.
//!
//! Tools, each optional: nginx (on `PATH` or `/usr/sbin/nginx`) serves the fake provider as a
//! fixed `return 200` answer (the streamed workload: a static file, chosen by the
//! `X-Bench-Stream` request header), so the provider is never the bottleneck; without it the provider is
//! the in-process mock from `tests/support` and the nginx target is skipped. `wrk` generates the
//! load (`-t1 -c1`, `-t2 -c32`, p50 from `--latency`); without it an in-process hyper client
//! loop does. Every server runs as a child process on free 127.0.0.1 ports with its
//! configuration in a temporary directory, and is stopped when the bench ends or panics.

#[path = "../tests/support/mod.rs"]
mod support;

use std::fmt::Write as _;
use std::fs;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use support::{full_body, MockUpstream, Reply, TestClient};

/// The compactor binary cargo built for this bench.
const COMPACTOR: &str = env!("CARGO_BIN_EXE_compactor");

/// Model named in every request: in the shipped models table (128k window), so the 200 KB
/// request (about 50k estimated tokens) stays well under the token trigger.
const MODEL: &str = "gpt-4o-mini";

/// Every request's path.
const PATH: &str = "/v1/chat/completions";

/// Every request's credential (nothing checks it; compactor derives session ids from it).
const AUTHORIZATION: &str = "Bearer sk-bench";

/// How long a server may take to answer its readiness probe. LiteLLM imports a lot at start.
const STARTUP: Duration = Duration::from_secs(180);

/// Goal: compactor's added p50 on 200 KB at c=1 is at most nginx's plus this.
const GOAL_LATENCY_MARGIN_US: f64 = 250.0;

/// Goal: compactor's req/s on 200 KB at c=32 is at least this fraction of nginx's.
const GOAL_LARGE_RPS_RATIO: f64 = 0.8;

/// Goal: compactor's req/s is at least this multiple of LiteLLM's.
const GOAL_LITELLM_MULTIPLE: f64 = 100.0;

/// Goal: compactor's p50 time to first byte of the streamed answer at c=1 is at most nginx's
/// plus this.
const GOAL_STREAM_TTFB_MARGIN_US: f64 = 100.0;

/// Events in the streamed answer.
const STREAM_EVENTS: usize = 500;

/// The request header that makes the fake provider stream (nginx picks the file by it).
const STREAM_HEADER: &str = "X-Bench-Stream";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Direct,
    Nginx,
    PassThrough,
    Compactor,
    /// Another build of compactor (`LOAD_BASELINE`), configured as `Compactor`: a change
    /// measured against the build before it in one run.
    Baseline,
    LiteLlm,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Direct => "direct",
            Kind::Nginx => "nginx",
            Kind::PassThrough => "pass-through",
            Kind::Compactor => "compactor",
            Kind::Baseline => "baseline",
            Kind::LiteLlm => "litellm",
        }
    }
}

/// One server under load.
struct Target {
    kind: Kind,
    port: u16,
    /// The process whose CPU time (with its children's: nginx's worker, LiteLLM's) is the
    /// target's; `None` for the in-process mock provider.
    pid: Option<u32>,
}

/// What changes from one request of a workload to the next.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Vary {
    /// Nothing: the same body every time (compactor's memos of the conversation hit).
    Same,
    /// The first user message: every request is a new conversation, all of it new.
    First,
    /// The last message (a new 50 KB turn): the next turn of the same conversation.
    Tail,
}

/// The placeholder a varying body carries where each request writes its own number (of the
/// same width, so the body's length stays the same).
const MARKER: &str = "VARY-000000000000";

/// `body` with [`MARKER`] replaced by request `n` of load generator `source`.
fn numbered(body: &[u8], source: u64, n: u64) -> Bytes {
    let text = String::from_utf8_lossy(body);
    let number = format!("{:05}-{:011}", source % 100_000, n % 100_000_000_000);
    debug_assert_eq!(number.len() + 5, MARKER.len());
    Bytes::from(text.replacen(MARKER, &format!("VARY-{number}"), 1))
}

/// One request body.
struct Workload {
    /// Its name in `LOAD_WORKLOADS`.
    key: &'static str,
    name: &'static str,
    body: Bytes,
    messages: usize,
    /// Answered with the [`STREAM_EVENTS`]-event stream (sent with [`STREAM_HEADER`]).
    stream: bool,
    /// What changes between requests.
    vary: Vary,
    /// The concurrencies it is measured at.
    concurrency: &'static [usize],
    /// wrk's Lua script posting `body` (only written when wrk is used).
    script: PathBuf,
}

/// One workload at one concurrency: a table in the report.
struct Cell {
    workload: usize,
    concurrency: usize,
}

/// What one measurement gave.
#[derive(Clone, Copy)]
struct Stats {
    p50_us: f64,
    rps: f64,
    /// Requests completed.
    requests: u64,
    /// Non-2xx answers and socket errors; any makes the figures suspect, so they are shown.
    errors: u64,
    /// The target's CPU time per request, where `/proc` tells it.
    cpu: Option<Cpu>,
}

/// CPU time per request, in microseconds: in user space and in the kernel on the process's
/// behalf (its share of the loopback TCP path, wake-ups).
#[derive(Clone, Copy)]
struct Cpu {
    user_us: f64,
    sys_us: f64,
}

/// `/proc`'s clock tick: the kernel reports `utime` and `stime` in units of `USER_HZ`, which
/// is 100 on every Linux architecture's ABI.
const USER_HZ: f64 = 100.0;

/// User and system CPU ticks of `pid` and of its live descendants (nginx's worker under its
/// master, LiteLLM's workers), from `/proc`; `None` where there is no `/proc`.
fn cpu_ticks(pid: u32) -> Option<(u64, u64)> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name, in parentheses, may hold spaces: fields are counted after it. utime
    // and stime are fields 14 and 15, the 12th and 13th after the name.
    let mut fields = stat.rsplit_once(')')?.1.split_whitespace().skip(11);
    let mut user: u64 = fields.next()?.parse().ok()?;
    let mut sys: u64 = fields.next()?.parse().ok()?;
    for task in fs::read_dir(format!("/proc/{pid}/task")).ok()?.flatten() {
        let children = fs::read_to_string(task.path().join("children")).unwrap_or_default();
        for child in children.split_whitespace().filter_map(|c| c.parse().ok()) {
            if let Some((u, s)) = cpu_ticks(child) {
                user += u;
                sys += s;
            }
        }
    }
    Some((user, sys))
}

/// Child processes, stopped (TERM, then KILL after a grace period) when dropped, including
/// when a panic unwinds, so a failed run leaves nothing listening.
#[derive(Default)]
struct Children(Vec<(String, Child)>);

impl Children {
    fn push(&mut self, name: &str, child: Child) -> &mut Child {
        self.0.push((name.to_owned(), child));
        &mut self.0.last_mut().expect("just pushed").1
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for (_, child) in self.0.iter_mut().rev() {
            stop(child);
        }
    }
}

/// TERM first: nginx's master only takes its workers down on a signal it can handle.
fn stop(child: &mut Child) {
    if matches!(child.try_wait(), Ok(Some(_))) {
        return;
    }
    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .stderr(Stdio::null())
        .status();
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline {
        if matches!(child.try_wait(), Ok(Some(_))) {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// `LOAD_SECS`, `LOAD_ROUNDS`, `LOAD_WORKLOADS` and `LOAD_BASELINE`.
struct Settings {
    secs: u64,
    rounds: usize,
    /// The workloads to run, by key; `None`: all.
    workloads: Option<Vec<String>>,
    /// Another compactor binary to run as the `baseline` target.
    baseline: Option<PathBuf>,
}

impl Settings {
    fn from_env() -> Settings {
        let var = |name: &str, default: u64| -> u64 {
            match std::env::var(name) {
                Ok(v) => v
                    .parse()
                    .unwrap_or_else(|_| panic!("{name}={v:?}: expected a whole number")),
                Err(_) => default,
            }
        };
        Settings {
            // wrk takes whole seconds.
            secs: var("LOAD_SECS", 3).max(1),
            rounds: var("LOAD_ROUNDS", 3).max(1) as usize,
            workloads: std::env::var("LOAD_WORKLOADS").ok().map(|v| {
                v.split(',')
                    .map(|w| w.trim().to_ascii_lowercase())
                    .filter(|w| !w.is_empty())
                    .collect()
            }),
            baseline: std::env::var_os("LOAD_BASELINE").map(PathBuf::from),
        }
    }
}

/// An executable on `PATH`, else the first of `fallbacks` that exists.
fn find_executable(name: &str, fallbacks: &[&str]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .chain(fallbacks.iter().map(PathBuf::from))
        .find(|candidate| candidate.is_file())
}

/// `n` distinct free ports on 127.0.0.1: all bound at once (so none repeats), then released
/// for the servers to take.
fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().expect("local addr").port())
        .collect()
}

/// The provider's answer to every request: a complete chat.completion with `usage`, so
/// compactor's calibration sees what a real provider sends.
fn provider_reply() -> Value {
    json!({
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Rome."},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42}
    })
}

/// The streamed answer: [`STREAM_EVENTS`] Chat Completions SSE events, as OpenAI sends them (a
/// `role` chunk, content chunks, the finish and `usage`, then `[DONE]`).
fn stream_reply() -> String {
    let chunk = |delta: Value, finish: Value, usage: Value| {
        let chunk = json!({"id": "chatcmpl-bench", "object": "chat.completion.chunk",
            "created": 1_700_000_000, "model": MODEL, "system_fingerprint": "fp_bench",
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
            "usage": usage});
        format!("data: {chunk}\n\n")
    };
    let mut events = vec![chunk(
        json!({"role": "assistant", "content": "", "refusal": null}),
        Value::Null,
        Value::Null,
    )];
    for i in 0..STREAM_EVENTS - 3 {
        events.push(chunk(
            json!({"content": format!("tok{i} ")}),
            Value::Null,
            Value::Null,
        ));
    }
    events.push(chunk(
        json!({}),
        json!("stop"),
        json!({"prompt_tokens": 40, "completion_tokens": STREAM_EVENTS - 3, "total_tokens": 40 + STREAM_EVENTS - 3}),
    ));
    events.push("data: [DONE]\n\n".to_owned());
    assert_eq!(events.len(), STREAM_EVENTS);
    events.concat()
}

/// A small streaming chat request.
fn stream_body() -> Bytes {
    Bytes::from(
        json!({"model": MODEL, "stream": true, "stream_options": {"include_usage": true},
               "messages": [{"role": "system", "content": "You are terse."},
                            {"role": "user", "content": lorem(600)}]})
        .to_string(),
    )
}

/// `len` characters of lorem ipsum.
fn lorem(len: usize) -> String {
    "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "
        .chars()
        .cycle()
        .take(len)
        .collect()
}

/// A Chat Completions request of exactly `size` bytes: a system prompt and `messages - 1`
/// messages alternating user / assistant, the text spread evenly over them.
fn chat_body(size: usize, messages: usize) -> Bytes {
    let roles: Vec<&str> = std::iter::once("system")
        .chain((1..messages).map(|i| if i % 2 == 1 { "user" } else { "assistant" }))
        .collect();
    let build = |each: usize, last_extra: usize| {
        let list: Vec<Value> = roles
            .iter()
            .enumerate()
            .map(|(i, role)| {
                let extra = if i + 1 == roles.len() { last_extra } else { 0 };
                json!({"role": role, "content": lorem(each + extra)})
            })
            .collect();
        json!({"model": MODEL, "messages": list}).to_string()
    };
    let room = size
        .checked_sub(build(0, 0).len())
        .unwrap_or_else(|| panic!("{messages} messages do not fit in {size} bytes"));
    let each = room / roles.len();
    let body = build(each, room - each * roles.len());
    assert_eq!(body.len(), size, "generated body size");
    Bytes::from(body)
}

/// [`chat_body`] with [`MARKER`] where `vary` changes it: at the start of the first user
/// message (`First`), or in a new last user message of `tail` bytes (`Tail`, on top of
/// `size`).
fn varying_chat_body(size: usize, messages: usize, vary: Vary, tail: usize) -> Bytes {
    let body = chat_body(size, messages);
    let mut v: Value = serde_json::from_slice(&body).expect("generated JSON");
    let list = v["messages"].as_array_mut().expect("messages");
    match vary {
        Vary::Same => return body,
        Vary::First => {
            let first = &mut list[1]["content"];
            let text = first.as_str().expect("text").to_owned();
            *first = json!(format!("{MARKER}{}", &text[MARKER.len()..]));
        }
        Vary::Tail => {
            if list.last().is_some_and(|m| m["role"] == "user") {
                list.push(json!({"role": "assistant", "content": "ok"}));
            }
            list.push(json!({"role": "user", "content": format!("{MARKER}{}", lorem(tail))}));
        }
    }
    Bytes::from(v.to_string())
}

/// One HTTP/1.1 exchange on a fresh connection (`Connection: close`): status and raw response.
/// Used for readiness probes and the pre-run check, not for measuring.
fn http_once(port: u16, method: &str, path: &str, body: &[u8]) -> std::io::Result<(u16, String)> {
    http_once_with(port, method, path, body, "")
}

/// [`http_once`] with `extra` header lines (each ending in `\r\n`).
fn http_once_with(
    port: u16,
    method: &str,
    path: &str,
    body: &[u8],
    extra: &str,
) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: {AUTHORIZATION}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n{extra}Connection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body)?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response)?;
    let text = String::from_utf8_lossy(&response).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    Ok((status, text))
}

/// Polls `GET path` on `port` until it answers 200; panics with the server's log if the child
/// exits first or [`STARTUP`] passes. The pause between polls is a retry interval.
fn wait_ready(name: &str, child: &mut Child, port: u16, path: &str, log: &Path) {
    let deadline = Instant::now() + STARTUP;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "{name} exited ({status}) before answering {path}:\n{}",
                fs::read_to_string(log).unwrap_or_default()
            );
        }
        if matches!(http_once(port, "GET", path, b""), Ok((200, _))) {
            return;
        }
        if Instant::now() >= deadline {
            panic!(
                "{name} did not answer GET {path} on port {port} within {STARTUP:?}:\n{}",
                fs::read_to_string(log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Spawns `command` with stdout and stderr in `log`, registered in `children`.
fn spawn<'a>(
    children: &'a mut Children,
    name: &str,
    mut command: Command,
    log: &Path,
) -> &'a mut Child {
    let file = fs::File::create(log).expect("create log file");
    command
        .stdin(Stdio::null())
        .stdout(file.try_clone().expect("clone log file"))
        .stderr(file);
    let child = command
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {name} ({command:?}): {e}"));
    children.push(name, child)
}

/// What an nginx instance does.
enum NginxRole {
    /// Answers every request with the fixed reply.
    Provider,
    /// Proxies to the provider on this port.
    Proxy { upstream: u16 },
}

/// Starts nginx in the foreground (`daemon off`, one worker) with a generated configuration
/// under `dir`, and waits until it answers.
fn start_nginx(
    children: &mut Children,
    nginx: &Path,
    dir: &Path,
    port: u16,
    role: NginxRole,
) -> Target {
    fs::create_dir_all(dir).expect("nginx dir");
    let d = dir.display();
    let kind = match role {
        NginxRole::Provider => Kind::Direct,
        NginxRole::Proxy { .. } => Kind::Nginx,
    };
    let (location, upstream_block) = match role {
        NginxRole::Provider => {
            let reply = provider_reply().to_string();
            // `return` text is a single-quoted nginx string that also expands variables.
            assert!(
                !reply.contains(['\'', '$', '\\']),
                "reply must not need nginx escaping"
            );
            // The stream is too long for a `return` string (nginx caps a configuration token
            // at 4 KB): a static file, which nginx refuses to POST (405) unless the error page
            // serves it as a 200. `X-Accel-Buffering: no` has the nginx proxy pass it on as it
            // reads it, as nginx is set up for event streams (`proxy_buffering off`).
            fs::write(dir.join("stream.sse"), stream_reply()).expect("write stream.sse");
            let header = STREAM_HEADER.to_ascii_lowercase().replace('-', "_");
            (
                format!(
                    "if ($http_{header}) {{ rewrite ^ /stream.sse last; }}\n        \
                     default_type application/json;\n        return 200 '{reply}';\n    \
                     }}\n        location = /stream.sse {{\n        internal;\n        \
                     root {d};\n        default_type text/event-stream;\n        \
                     add_header X-Accel-Buffering no;\n        \
                     error_page 405 =200 $uri;"
                ),
                String::new(),
            )
        }
        NginxRole::Proxy { upstream } => (
            "proxy_pass http://provider;\n        proxy_http_version 1.1;\n        \
             proxy_set_header Connection \"\";"
                .to_owned(),
            format!(
                "    upstream provider {{\n        server 127.0.0.1:{upstream};\n        \
                 keepalive 64;\n        keepalive_requests 1000000;\n    }}\n"
            ),
        ),
    };
    // Temp paths are set explicitly: distribution builds compile in /var/lib/nginx, which a
    // non-root user cannot write. keepalive_requests is raised (default 1000) so neither
    // nginx closes connections mid-run, as compactor never does.
    let config = format!(
        "worker_processes 1;\n\
         daemon off;\n\
         pid {d}/nginx.pid;\n\
         error_log stderr warn;\n\
         events {{ worker_connections 1024; }}\n\
         http {{\n    \
             access_log off;\n    \
             keepalive_requests 1000000;\n    \
             client_body_temp_path {d}/client_body;\n    \
             proxy_temp_path {d}/proxy;\n    \
             fastcgi_temp_path {d}/fastcgi;\n    \
             uwsgi_temp_path {d}/uwsgi;\n    \
             scgi_temp_path {d}/scgi;\n\
         {upstream_block}    \
             server {{\n        \
                 listen 127.0.0.1:{port};\n        \
                 client_max_body_size 64m;\n        \
                 client_body_buffer_size 1m;\n        \
                 location / {{\n        {location}\n        }}\n    \
             }}\n\
         }}\n"
    );
    let conf = dir.join("nginx.conf");
    fs::write(&conf, config).expect("write nginx.conf");
    let mut command = Command::new(nginx);
    command.arg("-p").arg(dir).arg("-c").arg(&conf);
    let log = dir.join("nginx.log");
    let child = spawn(children, "nginx", command, &log);
    wait_ready("nginx", child, port, "/", &log);
    let pid = Some(child.id());
    Target { kind, port, pid }
}

/// Starts `compactor serve` with a generated configuration under `dir` and waits for `/livez`.
fn start_compactor(
    children: &mut Children,
    dir: &Path,
    provider: &str,
    kind: Kind,
    binary: &Path,
) -> (Target, u16) {
    fs::create_dir_all(dir).expect("compactor dir");
    let ports = free_ports(2);
    let (port, admin) = (ports[0], ports[1]);
    // A message limit no request reaches and a window no request fills (a 1M-token model's
    // conversation of 4 MB is ~1M tokens): every chat request is parsed and checked, none is
    // compacted.
    let config = format!(
        "[server]\nlisten = \"127.0.0.1:{port}\"\nadmin_listen = \"127.0.0.1:{admin}\"\n\n\
         [upstream]\nbase_url = \"{provider}\"\n\n\
         [compaction]\nenabled = {}\nmax_messages = 1000000\n\n\
         [summarizer]\nbackend = \"extractive\"\n\n\
         [models.\"{MODEL}\"]\ncontext_window = 10000000\n",
        kind != Kind::PassThrough
    );
    let path = dir.join("compactor.toml");
    fs::write(&path, config).expect("write compactor.toml");
    let mut command = Command::new(binary);
    command
        .arg("serve")
        .arg("--config")
        .arg(&path)
        .current_dir(dir)
        .env("RUST_LOG", "info");
    for (key, _) in std::env::vars() {
        if key.starts_with("COMPACTOR_") {
            command.env_remove(key);
        }
    }
    let log = dir.join("compactor.log");
    let child = spawn(children, kind.label(), command, &log);
    wait_ready(kind.label(), child, admin, "/livez", &log);
    let pid = Some(child.id());
    (Target { kind, port, pid }, admin)
}

/// Starts LiteLLM's proxy with one model routed to the provider and waits until it is live.
fn start_litellm(children: &mut Children, litellm: &Path, dir: &Path, provider: &str) -> Target {
    fs::create_dir_all(dir).expect("litellm dir");
    let port = free_ports(1)[0];
    let config = format!(
        "model_list:\n  - model_name: {MODEL}\n    litellm_params:\n      model: openai/{MODEL}\n      \
         api_base: {provider}/v1\n      api_key: sk-bench\n"
    );
    let path = dir.join("litellm.yaml");
    fs::write(&path, config).expect("write litellm.yaml");
    let mut command = Command::new(litellm);
    command
        .arg("--config")
        .arg(&path)
        .arg("--host")
        .arg("127.0.0.1")
        .arg("--port")
        .arg(port.to_string())
        .current_dir(dir)
        .env("LITELLM_TELEMETRY", "False")
        // Recent LiteLLM refuses to start without a master key; the bench's own bearer token
        // is it (short, hence the permission for a weak key: a local benchmark only).
        .env(
            "LITELLM_MASTER_KEY",
            AUTHORIZATION.trim_start_matches("Bearer "),
        )
        .env(
            "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY",
            "true",
        );
    let log = dir.join("litellm.log");
    let child = spawn(children, "litellm", command, &log);
    wait_ready("litellm", child, port, "/health/liveliness", &log);
    Target {
        kind: Kind::LiteLlm,
        port,
        pid: Some(child.id()),
    }
}

/// One request through every target before measuring: each must answer 200 with the
/// provider's reply, and compactor must not have compacted.
fn check_target(target: &Target, workload: &Workload) {
    let extra = if workload.stream {
        format!("{STREAM_HEADER}: 1\r\n")
    } else {
        String::new()
    };
    let (status, response) = http_once_with(target.port, "POST", PATH, &workload.body, &extra)
        .unwrap_or_else(|e| panic!("{} {}: {e}", target.kind.label(), workload.name));
    let expected = if workload.stream {
        response.contains("chat.completion.chunk")
            && response.contains("data: [DONE]")
            && response.matches("data: ").count() == STREAM_EVENTS
    } else {
        response.contains("chat.completion")
    };
    assert!(
        status == 200 && expected,
        "{} answered {} to {}:\n{}",
        target.kind.label(),
        status,
        workload.name,
        response.chars().take(2000).collect::<String>()
    );
    assert!(
        !response
            .to_ascii_lowercase()
            .contains("x-compactor-compaction-num"),
        "{} compacted {}: the bench measures requests with no compaction due",
        target.kind.label(),
        workload.name
    );
}

/// The load generator.
enum Load {
    Wrk(PathBuf),
    /// In-process hyper client on the bench's runtime.
    InProcess(Arc<TestClient>),
}

/// Runs one measurement.
fn measure(
    load: &Load,
    runtime: &tokio::runtime::Runtime,
    target: &Target,
    workload: &Workload,
    concurrency: usize,
    secs: u64,
) -> Stats {
    let url = format!("http://127.0.0.1:{}{PATH}", target.port);
    let before = target.pid.and_then(cpu_ticks);
    let mut stats = match load {
        Load::Wrk(wrk) => run_wrk(wrk, &url, &workload.script, concurrency, secs),
        Load::InProcess(client) => runtime.block_on(client_cell(
            client.clone(),
            url,
            workload.body.clone(),
            workload.vary != Vary::Same,
            concurrency,
            secs,
        )),
    };
    let after = target.pid.and_then(cpu_ticks);
    if let (Some((u0, s0)), Some((u1, s1))) = (before, after) {
        let per_request = |ticks: u64| ticks as f64 / USER_HZ * 1e6 / stats.requests.max(1) as f64;
        stats.cpu = Some(Cpu {
            user_us: per_request(u1.saturating_sub(u0)),
            sys_us: per_request(s1.saturating_sub(s0)),
        });
    }
    stats
}

/// wrk's Lua script posting the body in `body_file` with the bench's headers (and
/// [`STREAM_HEADER`] for a streamed workload).
fn wrk_script(body_file: &Path, stream: bool, vary: Vary) -> String {
    let stream = if stream {
        format!("wrk.headers[\"{STREAM_HEADER}\"] = \"1\"\n")
    } else {
        String::new()
    };
    // A varying body: each request writes its thread's number and its own count over the
    // marker (same width, so the same length), as `numbered` does.
    let vary = if vary == Vary::Same {
        String::new()
    } else {
        format!(
            "local head, tail = nil, nil\n\
             local count = 0\n\
             local source = 0\n\
             function init(args)\n\
             \x20 source = math.random(0, 99999) + tonumber(tostring({{}}):match(\"0x(%x+)\") or \"0\", 16) % 1000\n\
             \x20 local i, j = wrk.body:find(\"{MARKER}\", 1, true)\n\
             \x20 head, tail = wrk.body:sub(1, i - 1), wrk.body:sub(j + 1)\n\
             end\n\
             function request()\n\
             \x20 count = count + 1\n\
             \x20 local number = string.format(\"VARY-%05d-%011d\", source % 100000, count)\n\
             \x20 return wrk.format(nil, nil, nil, head .. number .. tail)\n\
             end\n"
        )
    };
    format!(
        "-- compactor load bench: POST the workload body\n\
         wrk.method = \"POST\"\n\
         wrk.headers[\"Content-Type\"] = \"application/json\"\n\
         wrk.headers[\"Authorization\"] = \"{AUTHORIZATION}\"\n\
         {stream}\
         local file = assert(io.open(\"{}\", \"rb\"))\n\
         wrk.body = file:read(\"*a\")\n\
         file:close()\n\
         {vary}",
        body_file.display()
    )
}

/// Time to the first response byte, one request at a time on one kept-alive connection for
/// `secs`: the p50 over every request, from the request's last byte written to the first
/// byte of the answer read (the answer is then read whole before the next request).
fn ttfb_p50_us(port: u16, workload: &Workload, secs: u64) -> f64 {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect for TTFB");
    stream.set_nodelay(true).expect("nodelay");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    let mut request = format!(
        "POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: {AUTHORIZATION}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n{STREAM_HEADER}: 1\r\n\r\n",
        workload.body.len()
    )
    .into_bytes();
    request.extend_from_slice(&workload.body);
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut samples = Vec::new();
    let mut buf = Vec::with_capacity(256 * 1024);
    let mut chunk = vec![0u8; 64 * 1024];
    while Instant::now() < deadline {
        stream.write_all(&request).expect("write request");
        let sent = Instant::now();
        buf.clear();
        let n = stream.read(&mut chunk).expect("read the first byte");
        assert!(n > 0, "connection closed before an answer");
        samples.push(sent.elapsed().as_secs_f64() * 1e6);
        buf.extend_from_slice(&chunk[..n]);
        while !response_complete(&buf) {
            let n = stream.read(&mut chunk).expect("read the answer");
            assert!(n > 0, "connection closed mid-answer");
            buf.extend_from_slice(&chunk[..n]);
        }
        assert!(buf.starts_with(b"HTTP/1.1 200"), "not a 200 answer");
    }
    median(samples)
}

/// Whether `buf` holds a whole HTTP/1.1 response: its head and a body of `Content-Length`
/// bytes or of chunks up to the last.
fn response_complete(buf: &[u8]) -> bool {
    let Some(head_end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return false;
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let body = &buf[head_end + 4..];
    let header = |name: &str| {
        head.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':').map(str::trim))
            .map(str::to_owned)
    };
    if let Some(length) = header("content-length") {
        return length.parse::<usize>().is_ok_and(|n| body.len() >= n);
    }
    if header("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        let mut at = 0;
        loop {
            let Some(eol) = body[at..].windows(2).position(|w| w == b"\r\n") else {
                return false;
            };
            let line = String::from_utf8_lossy(&body[at..at + eol]);
            let size_text = line.split(';').next().unwrap_or("").trim();
            let Ok(size) = usize::from_str_radix(size_text, 16) else {
                panic!("bad chunk size {line:?}");
            };
            at += eol + 2;
            if size == 0 {
                // No trailers: the last chunk's line is followed by an empty line.
                return body.len() >= at + 2;
            }
            at += size + 2;
            if body.len() < at {
                return false;
            }
        }
    }
    panic!("an answer with neither Content-Length nor chunks")
}

/// One wrk run: one thread for one connection, two for more (the machine has two cores).
fn run_wrk(wrk: &Path, url: &str, script: &Path, concurrency: usize, secs: u64) -> Stats {
    let threads = if concurrency == 1 { 1 } else { 2 };
    let output = Command::new(wrk)
        .arg(format!("-t{threads}"))
        .arg(format!("-c{concurrency}"))
        .arg(format!("-d{secs}s"))
        .arg("--timeout")
        .arg("10s")
        .arg("--latency")
        .arg("-s")
        .arg(script)
        .arg(url)
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", wrk.display()));
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "wrk {url} failed ({}):\n{text}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    parse_wrk(&text).unwrap_or_else(|| panic!("unexpected wrk output for {url}:\n{text}"))
}

/// p50 (from the `--latency` distribution), Requests/sec and errors from wrk's report.
fn parse_wrk(text: &str) -> Option<Stats> {
    let mut lines = text.lines().map(str::trim);
    let mut p50_us = None;
    let mut rps = None;
    let mut requests = None;
    let mut errors = 0u64;
    while let Some(line) = lines.next() {
        if let Some((count, _)) = line.split_once(" requests in ") {
            requests = count.trim().parse().ok();
        } else if line == "Latency Distribution" {
            let first = lines.next()?;
            let value = first.strip_prefix("50%")?.trim();
            p50_us = Some(wrk_duration_us(value)?);
        } else if let Some(v) = line.strip_prefix("Requests/sec:") {
            rps = v.trim().parse().ok();
        } else if let Some(v) = line.strip_prefix("Non-2xx or 3xx responses:") {
            errors += v.trim().parse::<u64>().ok()?;
        } else if let Some(v) = line.strip_prefix("Socket errors:") {
            // "connect 0, read 0, write 0, timeout 0"
            for part in v.split(',') {
                errors += part.split_whitespace().nth(1)?.parse::<u64>().ok()?;
            }
        }
    }
    Some(Stats {
        p50_us: p50_us?,
        rps: rps?,
        requests: requests?,
        errors,
        cpu: None,
    })
}

/// A wrk duration such as `96.00us`, `1.25ms` or `2.00s`, in microseconds.
fn wrk_duration_us(value: &str) -> Option<f64> {
    let split = value.find(|c: char| c.is_ascii_alphabetic())?;
    let (number, unit) = value.split_at(split);
    let number: f64 = number.parse().ok()?;
    let scale = match unit {
        "us" => 1.0,
        "ms" => 1e3,
        "s" => 1e6,
        "m" => 60e6,
        _ => return None,
    };
    Some(number * scale)
}

/// The fallback load generator: `concurrency` tasks sending back to back for `secs`, each on
/// its own pooled connection; latency = send → full response body.
async fn client_cell(
    client: Arc<TestClient>,
    url: String,
    body: Bytes,
    vary: bool,
    concurrency: usize,
    secs: u64,
) -> Stats {
    let started = Instant::now();
    let deadline = started + Duration::from_secs(secs);
    let workers: Vec<_> = (0..concurrency)
        .map(|worker| {
            let (client, url, body) = (client.clone(), url.clone(), body.clone());
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut errors = 0u64;
                let mut n = 0;
                while Instant::now() < deadline {
                    n += 1;
                    let body = if vary {
                        numbered(&body, worker as u64, n)
                    } else {
                        body.clone()
                    };
                    match one_request(&client, &url, &body).await {
                        Some(elapsed) => latencies.push(elapsed),
                        None => errors += 1,
                    }
                }
                (latencies, errors)
            })
        })
        .collect();
    let mut latencies = Vec::new();
    let mut errors = 0;
    for worker in workers {
        let (l, e) = worker.await.expect("load task");
        latencies.extend(l);
        errors += e;
    }
    let wall = started.elapsed();
    assert!(!latencies.is_empty(), "no request to {url} succeeded");
    latencies.sort();
    Stats {
        p50_us: latencies[latencies.len() / 2].as_secs_f64() * 1e6,
        rps: latencies.len() as f64 / wall.as_secs_f64(),
        requests: latencies.len() as u64,
        errors,
        cpu: None,
    }
}

/// One request; `None` on a transport error or a non-2xx answer.
async fn one_request(client: &TestClient, url: &str, body: &Bytes) -> Option<Duration> {
    let request = Request::post(url)
        .header("content-type", "application/json")
        .header("authorization", AUTHORIZATION)
        .body(full_body(body.clone()))
        .expect("request");
    let started = Instant::now();
    let response = client.try_send(request).await.ok()?;
    let ok = response.status().is_success();
    response.into_body().collect().await.ok()?;
    ok.then(|| started.elapsed())
}

/// The median (the mean of the middle two for an even count).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

fn fmt_us(us: f64) -> String {
    if us.abs() >= 1000.0 {
        format!("{:.2}ms", us / 1000.0)
    } else {
        format!("{us:.0}µs")
    }
}

fn fmt_added(us: f64) -> String {
    let sign = if us < 0.0 { "−" } else { "+" };
    format!("{sign}{}", fmt_us(us.abs()))
}

/// Two decimals, three below 0.1 (LiteLLM's ratios would all read 0.00).
fn fmt_ratio(x: f64) -> String {
    if x < 0.1 {
        format!("{x:.3}×")
    } else {
        format!("{x:.2}×")
    }
}

fn fmt_rps(rps: f64) -> String {
    if rps >= 1000.0 {
        format!("{:.1}k", rps / 1000.0)
    } else {
        format!("{rps:.0}")
    }
}

fn met(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "NOT MET"
    }
}

/// Median over rounds of `f(round)`: figures comparing two targets are taken within a round
/// first (the targets ran seconds apart) and then the median across rounds.
fn paired(rounds: usize, f: impl Fn(usize) -> f64) -> f64 {
    median((0..rounds).map(f).collect())
}

fn main() {
    // `cargo bench` passes `--bench`. Anything else (`cargo test --benches`, `--all-targets`)
    // must not start servers and load the machine for minutes.
    if !std::env::args().any(|a| a == "--bench") {
        println!("load bench: run it with `cargo bench --bench load`");
        return;
    }
    let settings = Settings::from_env();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    // Declared before the children so it is removed after they stop writing into it.
    let dir = tempfile::tempdir().expect("temp dir");
    let mut children = Children::default();

    let nginx = find_executable("nginx", &["/usr/sbin/nginx"]);
    let wrk = find_executable("wrk", &[]);
    let litellm = find_executable("litellm", &[]);
    let version = |exe: &Path, arg: &str| {
        Command::new(exe)
            .arg(arg)
            .output()
            .ok()
            .map(|o| {
                let text = [o.stdout, o.stderr].concat();
                String::from_utf8_lossy(&text)
                    .lines()
                    .next()
                    .unwrap_or("")
                    .trim()
                    .to_owned()
            })
            .unwrap_or_default()
    };

    // The fake provider, and the direct target.
    let mut _mock = None;
    let direct = match &nginx {
        Some(nginx) => {
            let port = free_ports(1)[0];
            start_nginx(
                &mut children,
                nginx,
                &dir.path().join("provider"),
                port,
                NginxRole::Provider,
            )
        }
        None => {
            let mock = runtime.block_on(MockUpstream::start());
            mock.set_recording(false);
            let reply = provider_reply();
            let stream = Bytes::from(stream_reply());
            mock.set_handler(move |r| {
                if r.header(STREAM_HEADER).is_some() {
                    Reply::bytes(200, "text/event-stream", stream.clone())
                } else {
                    Reply::json(200, &reply)
                }
            });
            let port = mock.addr().port();
            _mock = Some(mock);
            Target {
                kind: Kind::Direct,
                port,
                pid: None,
            }
        }
    };
    let provider = format!("http://127.0.0.1:{}", direct.port);

    let mut notes = Vec::new();
    let mut targets = vec![direct];
    match &nginx {
        Some(nginx) => {
            let port = free_ports(1)[0];
            targets.push(start_nginx(
                &mut children,
                nginx,
                &dir.path().join("proxy"),
                port,
                NginxRole::Proxy {
                    upstream: targets[0].port,
                },
            ));
        }
        None => notes.push(
            "nginx not found (PATH, /usr/sbin/nginx): provider is the in-process mock, \
             no nginx target, nginx goals not checked",
        ),
    }
    let (pass_through, _) = start_compactor(
        &mut children,
        &dir.path().join("pass-through"),
        &provider,
        Kind::PassThrough,
        Path::new(COMPACTOR),
    );
    targets.push(pass_through);
    let (compactor, compactor_admin) = start_compactor(
        &mut children,
        &dir.path().join("compactor"),
        &provider,
        Kind::Compactor,
        Path::new(COMPACTOR),
    );
    targets.push(compactor);
    if let Some(binary) = &settings.baseline {
        let (baseline, _) = start_compactor(
            &mut children,
            &dir.path().join("baseline"),
            &provider,
            Kind::Baseline,
            binary,
        );
        targets.push(baseline);
    }
    match &litellm {
        Some(litellm) => targets.push(start_litellm(
            &mut children,
            litellm,
            &dir.path().join("litellm"),
            &provider,
        )),
        None => notes.push("litellm not on PATH: LiteLLM skipped"),
    }

    const BOTH: &[usize] = &[1, 32];
    let workload = |key, name, body, messages, vary, concurrency| Workload {
        key,
        name,
        body,
        messages,
        stream: false,
        vary,
        concurrency,
        script: PathBuf::new(),
    };
    let mut workloads = vec![
        workload("1kb", "1 KB chat", chat_body(1024, 4), 4, Vary::Same, BOTH),
        workload(
            "200kb",
            "200 KB chat",
            chat_body(200 * 1024, 769),
            769,
            Vary::Same,
            BOTH,
        ),
        workload(
            "200kb-new",
            "200 KB chat, all new",
            varying_chat_body(200 * 1024, 769, Vary::First, 0),
            769,
            Vary::First,
            BOTH,
        ),
        workload(
            "4mb-new",
            "4 MB chat, all new",
            varying_chat_body(4 << 20, 15_000, Vary::First, 0),
            15_000,
            Vary::First,
            &[1],
        ),
        workload(
            "4mb-tail",
            "4 MB chat, a new 50 KB turn",
            varying_chat_body((4 << 20) - (50 << 10), 15_000, Vary::Tail, 50 << 10),
            15_002,
            Vary::Tail,
            &[1],
        ),
        Workload {
            stream: true,
            ..workload(
                "stream",
                "streamed chat (500 events)",
                stream_body(),
                2,
                Vary::Same,
                BOTH,
            )
        },
    ];
    if let Some(keys) = &settings.workloads {
        for key in keys {
            assert!(
                workloads.iter().any(|w| w.key == key),
                "LOAD_WORKLOADS: unknown workload {key:?} (1kb, 200kb, 200kb-new, 4mb-new, 4mb-tail, stream)"
            );
        }
        workloads.retain(|w| keys.iter().any(|k| k == w.key));
    }
    for (i, workload) in workloads.iter_mut().enumerate() {
        let body_file = dir.path().join(format!("body-{i}.json"));
        fs::write(&body_file, &workload.body).expect("write body file");
        workload.script = dir.path().join(format!("post-{i}.lua"));
        fs::write(
            &workload.script,
            wrk_script(&body_file, workload.stream, workload.vary),
        )
        .expect("write wrk script");
    }
    for target in &targets {
        for workload in &workloads {
            check_target(target, workload);
        }
    }

    let load = match &wrk {
        Some(wrk) => Load::Wrk(wrk.clone()),
        None => {
            notes.push("wrk not found: load from the in-process hyper client");
            Load::InProcess(Arc::new(runtime.block_on(async { TestClient::http1() })))
        }
    };
    let cells: Vec<Cell> = workloads
        .iter()
        .enumerate()
        .flat_map(|(workload, w)| {
            w.concurrency.iter().map(move |&concurrency| Cell {
                workload,
                concurrency,
            })
        })
        .collect();

    println!(
        "compactor load bench: {} rounds × {} s per measurement (LOAD_ROUNDS, LOAD_SECS), {} cores",
        settings.rounds,
        settings.secs,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "provider: {}; load: {}",
        match &nginx {
            Some(path) => format!("nginx return 200 ({})", version(path, "-v")),
            None => "in-process mock".to_owned(),
        },
        match &wrk {
            Some(path) => {
                let version = version(path, "--version");
                let version = version.split(" Copyright").next().unwrap_or_default();
                format!("{version} (-t1 -c1 / -t2 -c32)")
            }
            None => "in-process hyper client".to_owned(),
        }
    );
    if let Some(path) = &litellm {
        println!("litellm: {}", path.display());
    }
    for note in &notes {
        println!("note: {note}");
    }
    println!(
        "targets: {}",
        targets
            .iter()
            .map(|t| t.kind.label())
            .collect::<Vec<_>>()
            .join(", ")
    );

    // results[cell][target][round]
    let mut results: Vec<Vec<Vec<Stats>>> = cells
        .iter()
        .map(|_| targets.iter().map(|_| Vec::new()).collect())
        .collect();
    // The streamed workload's time to first byte at c=1: ttfbs[target][round], in µs.
    let streamed = workloads.iter().position(|w| w.stream);
    let mut ttfbs: Vec<Vec<f64>> = targets.iter().map(|_| Vec::new()).collect();
    let total = Instant::now();
    for round in 0..settings.rounds {
        let started = Instant::now();
        for (c, cell) in cells.iter().enumerate() {
            // Rotating the order keeps any drift within a round (heat, a neighbour's job)
            // from always landing on the same target.
            for i in 0..targets.len() {
                let t = (i + round) % targets.len();
                let stats = measure(
                    &load,
                    &runtime,
                    &targets[t],
                    &workloads[cell.workload],
                    cell.concurrency,
                    settings.secs,
                );
                results[c][t].push(stats);
            }
        }
        if let Some(w) = streamed {
            for i in 0..targets.len() {
                let t = (i + round) % targets.len();
                ttfbs[t].push(ttfb_p50_us(targets[t].port, &workloads[w], settings.secs));
            }
        }
        eprintln!(
            "round {}/{} done in {:.0} s",
            round + 1,
            settings.rounds,
            started.elapsed().as_secs_f64()
        );
    }

    let find = |kind: Kind| targets.iter().position(|t| t.kind == kind);
    let (i_direct, i_nginx) = (0, find(Kind::Nginx));
    let i_pass = find(Kind::PassThrough).expect("pass-through target");
    let i_comp = find(Kind::Compactor).expect("compactor target");
    let i_lite = find(Kind::LiteLlm);
    let rounds = settings.rounds;

    let mut report = String::new();
    // p50s[cell][target]: medians of the rounds.
    let mut p50s: Vec<Vec<f64>> = Vec::new();
    for (c, cell) in cells.iter().enumerate() {
        let r = &results[c];
        let workload = &workloads[cell.workload];
        let _ = writeln!(
            report,
            "\n{} ({} messages, {} bytes), c={}",
            workload.name,
            workload.messages,
            workload.body.len(),
            cell.concurrency
        );
        let _ = writeln!(
            report,
            "  {:<13} {:>9} {:>10} {:>8} {:>9} {:>10} {:>16} {:>16}",
            "target",
            "p50",
            "added p50",
            "req/s",
            "vs nginx",
            "vs direct",
            "req/s rounds",
            "CPU/req usr+sys"
        );
        let mut cell_p50s = Vec::new();
        for (t, target) in targets.iter().enumerate() {
            let p50 = median(r[t].iter().map(|s| s.p50_us).collect());
            let rps = median(r[t].iter().map(|s| s.rps).collect());
            let added = paired(rounds, |k| r[t][k].p50_us - r[i_direct][k].p50_us);
            let ratio = |other: usize| paired(rounds, |k| r[t][k].rps / r[other][k].rps);
            let spread = format!(
                "{}–{}",
                fmt_rps(r[t].iter().map(|s| s.rps).fold(f64::INFINITY, f64::min)),
                fmt_rps(r[t].iter().map(|s| s.rps).fold(0.0, f64::max))
            );
            let added = if t == i_direct {
                "—".to_owned()
            } else {
                fmt_added(added)
            };
            let vs_nginx = i_nginx.map_or("—".to_owned(), |n| fmt_ratio(ratio(n)));
            let vs_direct = fmt_ratio(ratio(i_direct));
            let cpu = if r[t].iter().all(|s| s.cpu.is_some()) {
                let of = |f: fn(&Cpu) -> f64| {
                    median(r[t].iter().flat_map(|s| s.cpu.as_ref().map(f)).collect())
                };
                format!("{:.1}+{:.1}µs", of(|c| c.user_us), of(|c| c.sys_us))
            } else {
                "—".to_owned()
            };
            let errors: u64 = r[t].iter().map(|s| s.errors).sum();
            let errors = if errors > 0 {
                format!("  ({errors} errors: figures suspect)")
            } else {
                String::new()
            };
            let _ = writeln!(
                report,
                "  {:<13} {:>9} {:>10} {:>8} {:>9} {:>10} {:>16} {:>16}{errors}",
                target.kind.label(),
                fmt_us(p50),
                added,
                fmt_rps(rps),
                vs_nginx,
                vs_direct,
                spread,
                cpu,
            );
            cell_p50s.push(p50);
        }
        p50s.push(cell_p50s);
    }
    if let Some(w) = streamed {
        let _ = writeln!(
            report,
            "\n{}: time to first byte at c=1 (p50), events/s at c=32",
            workloads[w].name
        );
        let _ = writeln!(
            report,
            "  {:<13} {:>9} {:>11} {:>11} {:>11}",
            "target", "TTFB p50", "added", "events/s", "vs nginx"
        );
        let c32 = cells
            .iter()
            .position(|c| c.workload == w && c.concurrency == 32)
            .expect("the streamed c=32 cell");
        for (t, target) in targets.iter().enumerate() {
            let ttfb = median(ttfbs[t].clone());
            let added = paired(rounds, |k| ttfbs[t][k] - ttfbs[i_direct][k]);
            let events = median(
                results[c32][t]
                    .iter()
                    .map(|s| s.rps * STREAM_EVENTS as f64)
                    .collect(),
            );
            let vs_nginx = i_nginx.map_or("—".to_owned(), |n| {
                fmt_ratio(paired(rounds, |k| {
                    results[c32][t][k].rps / results[c32][n][k].rps
                }))
            });
            let _ = writeln!(
                report,
                "  {:<13} {:>9} {:>11} {:>11} {:>11}",
                target.kind.label(),
                fmt_us(ttfb),
                if t == i_direct {
                    "—".to_owned()
                } else {
                    fmt_added(added)
                },
                fmt_rps(events),
                vs_nginx
            );
        }
    }
    print!("{report}");
    println!(
        "\np50 and req/s: medians of the rounds; added p50 and ratios: medians of the per-round \
         figures (each round compares targets measured seconds apart). Latency = request sent → \
         response received, as the load generator sees it. CPU/req: the target's own processes \
         (user space + kernel), from /proc, medians of the rounds; direct's is the provider's."
    );

    // Goals, read from the figures above, for the workloads that ran.
    let workload_of = |key: &str| workloads.iter().position(|w| w.key == key);
    let cell_of = |workload: Option<usize>, concurrency: usize| {
        cells
            .iter()
            .position(|c| Some(c.workload) == workload && c.concurrency == concurrency)
    };
    let (small, large) = (workload_of("1kb"), workload_of("200kb"));
    let added = |c: usize, t: usize| {
        let r = &results[c];
        paired(rounds, |k| r[t][k].p50_us - r[i_direct][k].p50_us)
    };
    let ratio = |c: usize, t: usize, other: usize| {
        let r = &results[c];
        paired(rounds, |k| r[t][k].rps / r[other][k].rps)
    };
    println!("\ngoals");
    match i_nginx {
        Some(n) => {
            if let Some(c) = cell_of(large, 1) {
                let (comp, ngx) = (added(c, i_comp), added(c, n));
                println!(
                    "  200 KB c=1: compactor added p50 {} ≤ nginx added p50 {} + {} µs: {}",
                    fmt_added(comp),
                    fmt_added(ngx),
                    GOAL_LATENCY_MARGIN_US,
                    met(comp <= ngx + GOAL_LATENCY_MARGIN_US)
                );
            }
            if let Some(c) = cell_of(small, 32) {
                let x = ratio(c, i_comp, n);
                println!(
                    "  1 KB c=32: compactor req/s ≥ nginx's: {x:.2}× nginx: {}",
                    met(x >= 1.0)
                );
            }
            if let Some(c) = cell_of(large, 32) {
                let x = ratio(c, i_comp, n);
                println!(
                    "  200 KB c=32: compactor req/s ≥ {GOAL_LARGE_RPS_RATIO} × nginx's: {x:.2}× nginx: {}",
                    met(x >= GOAL_LARGE_RPS_RATIO)
                );
            }
            if streamed.is_some() {
                let comp = median(ttfbs[i_comp].clone());
                let ngx = median(ttfbs[n].clone());
                println!(
                    "  streamed c=1: compactor TTFB p50 {} ≤ nginx's {} + {} µs: {}",
                    fmt_us(comp),
                    fmt_us(ngx),
                    GOAL_STREAM_TTFB_MARGIN_US,
                    met(comp <= ngx + GOAL_STREAM_TTFB_MARGIN_US)
                );
                if let Some(c) = cell_of(streamed, 32) {
                    let x = ratio(c, i_comp, n);
                    println!(
                        "  streamed c=32: compactor events/s ≥ nginx's: {x:.2}× nginx: {}",
                        met(x >= 1.0)
                    );
                }
            }
        }
        None => println!("  nginx goals: not checked (no nginx)"),
    }
    match i_lite {
        Some(l) => {
            for (c, cell) in cells.iter().enumerate() {
                let x = ratio(c, i_comp, l);
                println!(
                    "  {} c={}: compactor req/s ≥ {GOAL_LITELLM_MULTIPLE} × LiteLLM's: {x:.0}×: {}",
                    workloads[cell.workload].name,
                    cell.concurrency,
                    met(x >= GOAL_LITELLM_MULTIPLE)
                );
            }
        }
        None => println!("  LiteLLM goal: not checked (no litellm)"),
    }

    println!("\ncompactor vs its own pass-through (the cost of inspecting chat requests)");
    for (c, cell) in cells.iter().enumerate() {
        let r = &results[c];
        let diff = paired(rounds, |k| r[i_comp][k].p50_us - r[i_pass][k].p50_us);
        println!(
            "  {} c={}: p50 {} ({} vs {}), req/s {:.2}× pass-through",
            workloads[cell.workload].name,
            cell.concurrency,
            fmt_added(diff),
            fmt_us(p50s[c][i_comp]),
            fmt_us(p50s[c][i_pass]),
            ratio(c, i_comp, i_pass)
        );
    }

    // compactor's own count: the run is only meaningful if nothing was compacted.
    match http_once(compactor_admin, "GET", "/metrics", b"") {
        Ok((200, text)) => {
            let compactions: f64 = text
                .lines()
                .filter(|l| l.starts_with("compactor_compactions_total{"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum();
            println!("\ncompactions during the run: {compactions} (expected 0)");
        }
        other => println!("\ncompactor /metrics unavailable: {other:?}"),
    }
    println!("total {:.0} s", total.elapsed().as_secs_f64());
    drop(children);
}
