//! A scripted provider for the real agent CLIs (`tests/real_agents.rs`): the mock upstream
//! answering Anthropic Messages, OpenAI Responses, Chat Completions and Gemini
//! `generateContent` in their streaming (and plain) shapes, playing a coding session. For [`Script::turns`] turns it answers with a call
//! of the agent's shell tool running `echo step-K; seq ...` (the output grows the
//! conversation), then with a final text answer (or, for agents that only stop on a command,
//! [`Finish::Command`]). Which step comes next is read from the request itself: the `step-K`
//! marker in its last tool result, which every compaction keeps verbatim; so a compacted
//! conversation goes on where it was.
//!
//! Every chat request is checked with the provider rules (`provider_rules`,
//! `anthropic_rules`, `responses_rules`, and Gemini's from `compactor-plugin-testing`) against
//! [`Script::window`]; a request breaking them is refused with the provider's real 400
//! (Anthropic `prompt is too long: M tokens > N maximum`, OpenAI `context_length_exceeded`,
//! Gemini `The input token count (M) exceeds the maximum number of tokens allowed (N).`, or
//! `invalid_request_error` / `INVALID_ARGUMENT`). Side calls are answered
//! plausibly: a request without tools (a title or topic) with a short text, `count_tokens`
//! (and Gemini's `:countTokens`) with bytes / 4, `GET …/models` with the script's model, and an HTTP/1.1 upgrade (Codex's
//! WebSocket) with 426 so the client falls back to HTTP at once. Every request and its answer
//! is logged ([`ScriptedProvider::exchanges`]).
//!
//! Two shapes of today's agents that the rules (written for the public APIs) do not know are
//! normalised before the check, and only for it: Claude Code 2.1 sends a `system`-role message
//! in `messages` (its environment, right after the first user turn: a mid-conversation system
//! turn), left out of the structural check and counted in the window; Codex gives its own
//! developer and user messages ids (`msg_<uuid>`), which the Responses rules would read as the
//! output of a response with reasoning, so ids are dropped from messages that are not the
//! assistant's.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use serde_json::{json, Value};

use super::mock::{MockUpstream, Recorded, Reply};
use super::{anthropic_rules, provider_rules, responses_rules};
use compactor_plugin_testing::rules::{gemini as gemini_rules, Rejection};

/// The API of a chat request, from its path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `…/messages`
    Messages,
    /// `…/responses`
    Responses,
    /// `…/chat/completions`
    Chat,
    /// `…/models/{model}:generateContent` or `:streamGenerateContent` (streamed)
    Gemini,
}

impl Api {
    fn of(path: &str) -> Option<Api> {
        if path.ends_with(":generateContent") || path.ends_with(":streamGenerateContent") {
            Some(Api::Gemini)
        } else if path.ends_with("/messages") {
            Some(Api::Messages)
        } else if path.ends_with("/responses") {
            Some(Api::Responses)
        } else if path.ends_with("/chat/completions") {
            Some(Api::Chat)
        } else {
            None
        }
    }
}

/// How the session ends after the last step.
#[derive(Debug, Clone)]
pub enum Finish {
    /// A final text answer (no tool call): Claude Code, Codex, opencode stop on it.
    Text,
    /// One more tool call running this command (mini-swe-agent stops when it runs
    /// `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`); nothing is asked after it.
    Command(String),
}

/// The session the provider plays.
#[derive(Debug, Clone)]
pub struct Script {
    /// Tool-call turns before the finish.
    pub turns: usize,
    /// The window, in tokens as the rules count them (4 characters each over the system
    /// prompt and the messages), past which a request is refused for its length.
    pub window: usize,
    /// Lines of `seq` output each step prints (about 6 bytes a line).
    pub filler_lines: usize,
    /// How the session ends.
    pub finish: Finish,
    /// The model `GET …/models` lists.
    pub model: String,
    /// How long each answer takes (a model's latency; zero for none).
    pub latency: std::time::Duration,
}

/// What the provider answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// A call of the shell tool running step `K` (1-based).
    Step(usize),
    /// The final answer ([`Finish`]).
    Final,
    /// A chat request without tools (a title, a topic): a short text.
    Side,
    /// A 400 for this reason.
    Refused(Rejection),
    /// A non-chat call (`count_tokens`, models, an upgrade, an unknown path) with this status.
    Other(u16),
}

/// One request and the provider's answer.
#[derive(Debug, Clone)]
pub struct Exchange {
    /// The request as received.
    pub request: Recorded,
    /// Its API, for a chat request.
    pub api: Option<Api>,
    /// The answer.
    pub answer: Answer,
    /// Something the script did not expect (a tool result without the step marker, no shell
    /// tool offered): the test fails on any.
    pub anomaly: Option<String>,
}

impl Exchange {
    /// The request body as JSON (`Null` when it is not JSON).
    pub fn body(&self) -> Value {
        serde_json::from_slice(&self.request.body).unwrap_or(Value::Null)
    }

    /// Whether this request was a turn of the scripted session (answered with a step or the
    /// finish).
    pub fn is_session_turn(&self) -> bool {
        matches!(self.answer, Answer::Step(_) | Answer::Final)
    }

    /// One line for a failure message.
    pub fn line(&self) -> String {
        let body = self.body();
        let items = body["messages"]
            .as_array()
            .or_else(|| body["input"].as_array())
            .or_else(|| body["contents"].as_array())
            .map_or(0, Vec::len);
        format!(
            "{} {} ({} bytes, {} items, stream={}) -> {:?}{}",
            self.request.method,
            self.request.path_and_query,
            self.request.body.len(),
            items,
            body["stream"] == true,
            self.answer,
            self.anomaly
                .as_deref()
                .map(|a| format!(" ANOMALY: {a}"))
                .unwrap_or_default()
        )
    }
}

struct State {
    script: Script,
    log: Mutex<Vec<Exchange>>,
    /// The latest bodies answered, for the prompt cache ([`cached_tokens`]).
    recent: Mutex<Vec<Vec<u8>>>,
    /// Numbers the responses (ids `msg_N`, `resp_N`, `rs_N`, `toolu_N`, `call_N`).
    next: AtomicUsize,
}

/// The scripted provider: a [`MockUpstream`] with the script as its handler.
pub struct ScriptedProvider {
    mock: MockUpstream,
    state: Arc<State>,
}

impl ScriptedProvider {
    /// Starts the provider on `127.0.0.1:0`.
    pub async fn start(script: Script) -> ScriptedProvider {
        let mock = MockUpstream::start().await;
        mock.set_latency(script.latency);
        let state = Arc::new(State {
            script,
            log: Mutex::new(Vec::new()),
            recent: Mutex::new(Vec::new()),
            next: AtomicUsize::new(1),
        });
        let handler_state = state.clone();
        mock.set_handler(move |req: &Recorded| {
            let (reply, exchange) = answer(&handler_state, req);
            handler_state.log.lock().expect("log lock").push(exchange);
            reply
        });
        ScriptedProvider { mock, state }
    }

    /// `http://127.0.0.1:PORT`, no trailing slash.
    pub fn url(&self) -> String {
        self.mock.url()
    }

    /// Every request so far with its answer, in arrival order.
    pub fn exchanges(&self) -> Vec<Exchange> {
        self.state.log.lock().expect("log lock").clone()
    }

    /// The requests that were turns of the scripted session (refused ones left out).
    pub fn session_turns(&self) -> Vec<Exchange> {
        self.exchanges()
            .into_iter()
            .filter(Exchange::is_session_turn)
            .collect()
    }

    /// The whole log, one line a request, for failure messages.
    pub fn report(&self) -> String {
        self.exchanges()
            .iter()
            .enumerate()
            .map(|(i, e)| format!("  #{i}: {}", e.line()))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// The shell command of step `k`: the marker, then `filler_lines` lines of numbers.
pub fn step_command(k: usize, filler_lines: usize) -> String {
    let first = k * 100_000;
    format!(
        "echo step-{k}; seq {first} {}",
        first + filler_lines.saturating_sub(1)
    )
}

/// The text of the final answer.
pub fn final_text(turns: usize) -> String {
    format!("all {turns} scripted steps ran; the session is complete.")
}

fn answer(state: &State, req: &Recorded) -> (Reply, Exchange) {
    let mut exchange = Exchange {
        request: req.clone(),
        api: None,
        answer: Answer::Other(200),
        anomaly: None,
    };
    let path = req.path();
    let reply = if req.header("upgrade").is_some() {
        // Codex's WebSocket attempt: no WebSocket here, so it falls back to HTTP at once.
        exchange.answer = Answer::Other(426);
        Reply::json(
            426,
            &json!({"error": {"message": "WebSocket is not supported here; use HTTP", "type": "invalid_request_error", "code": "upgrade_required"}}),
        )
    } else if req.method == http::Method::GET && path.ends_with("/models") {
        models(state, req)
    } else if req.method == http::Method::POST && path.ends_with("/messages/count_tokens") {
        Reply::json(200, &json!({"input_tokens": req.body.len().div_ceil(4)}))
    } else if req.method == http::Method::POST && path.ends_with(":countTokens") {
        Reply::json(200, &json!({"totalTokens": req.body.len().div_ceil(4)}))
    } else if let (true, Some(api)) = (req.method == http::Method::POST, Api::of(path)) {
        exchange.api = Some(api);
        chat(state, req, api, &mut exchange)
    } else {
        exchange.answer = Answer::Other(404);
        Reply::json(
            404,
            &json!({"error": {"message": format!("unknown path {path}"), "type": "invalid_request_error", "code": "not_found"}}),
        )
    };
    (reply, exchange)
}

fn models(state: &State, req: &Recorded) -> Reply {
    let model = &state.script.model;
    if req.header("anthropic-version").is_some() {
        Reply::json(
            200,
            &json!({"data": [{"type": "model", "id": model, "display_name": model,
                              "created_at": "2026-01-01T00:00:00Z"}],
                    "has_more": false, "first_id": model, "last_id": model}),
        )
    } else {
        Reply::json(
            200,
            &json!({"object": "list", "data": [{"id": model, "object": "model",
                                                "created": 1_700_000_000, "owned_by": "scripted"}]}),
        )
    }
}

/// The request as the rules should see it (see the module doc).
fn normalised(api: Api, body: &Value) -> Value {
    let mut body = body.clone();
    match api {
        Api::Messages => {
            let Some(messages) = body["messages"].as_array().cloned() else {
                return body;
            };
            let (system_turns, rest): (Vec<Value>, Vec<Value>) =
                messages.into_iter().partition(|m| m["role"] == "system");
            if !system_turns.is_empty() {
                let mut system = match body["system"].take() {
                    Value::String(s) => vec![json!({"type": "text", "text": s})],
                    Value::Array(blocks) => blocks,
                    _ => Vec::new(),
                };
                for m in system_turns {
                    match &m["content"] {
                        Value::String(s) => system.push(json!({"type": "text", "text": s})),
                        Value::Array(blocks) => system.extend(blocks.iter().cloned()),
                        _ => {}
                    }
                }
                body["system"] = Value::Array(system);
                body["messages"] = Value::Array(rest);
            }
        }
        Api::Responses => {
            if let Some(items) = body["input"].as_array_mut() {
                for item in items {
                    let is_message = item["type"].as_str().unwrap_or("message") == "message";
                    if is_message && item["role"] != "assistant" {
                        if let Some(o) = item.as_object_mut() {
                            o.remove("id");
                        }
                    }
                }
            }
        }
        Api::Chat | Api::Gemini => {}
    }
    body
}

fn check(api: Api, body: &Value, window: usize) -> Result<(), Rejection> {
    let body = normalised(api, body);
    match api {
        Api::Messages => anthropic_rules::check_messages(&body, window),
        Api::Responses => responses_rules::check_responses(&body, window),
        Api::Chat => provider_rules::check_chat(&body, window),
        Api::Gemini => gemini_rules::check_gemini(&body, window),
    }
}

fn rejection(api: Api, r: &Rejection) -> Reply {
    let body = match api {
        Api::Messages => anthropic_rules::rejection_body(r),
        Api::Responses => responses_rules::rejection_body(r),
        Api::Chat => provider_rules::rejection_body(r),
        Api::Gemini => gemini_rules::rejection_body(r),
    };
    let reply = Reply::json(400, &body);
    match api {
        Api::Messages => reply.with_header("request-id", "req_scripted_refusal"),
        _ => reply.with_header("x-request-id", "req_scripted_refusal"),
    }
}

/// The text of a tool result's content: a string, or its blocks' text.
fn text_of(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str().or_else(|| p["output"].as_str()))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// The last tool result of the conversation, if any.
fn last_tool_result(api: Api, body: &Value) -> Option<String> {
    match api {
        Api::Messages => body["messages"]
            .as_array()?
            .iter()
            .flat_map(|m| m["content"].as_array().into_iter().flatten())
            .rfind(|b| b["type"] == "tool_result")
            .map(|b| text_of(&b["content"])),
        Api::Responses => body["input"]
            .as_array()?
            .iter()
            .rfind(|i| {
                i["type"]
                    .as_str()
                    .is_some_and(|t| t.ends_with("_call_output"))
            })
            .map(|i| text_of(&i["output"])),
        Api::Chat => body["messages"]
            .as_array()?
            .iter()
            .rfind(|m| m["role"] == "tool")
            .map(|m| text_of(&m["content"])),
        Api::Gemini => body["contents"]
            .as_array()?
            .iter()
            .flat_map(|c| c["parts"].as_array().into_iter().flatten())
            .rfind(|p| p.get("functionResponse").is_some())
            .map(|p| {
                let response = &p["functionResponse"]["response"];
                response["output"]
                    .as_str()
                    .or_else(|| response["error"].as_str())
                    .map_or_else(|| response.to_string(), str::to_owned)
            }),
    }
}

/// Whether the request's last turn is compactor's summary request (its compaction task,
/// which opens with `<task>`, after the conversation).
fn asks_for_summary(api: Api, body: &Value) -> bool {
    let items = match api {
        Api::Messages | Api::Chat => &body["messages"],
        Api::Responses => &body["input"],
        Api::Gemini => &body["contents"],
    };
    items
        .as_array()
        .and_then(|items| items.last())
        .is_some_and(|last| last.to_string().contains("<task>\\n"))
}

/// The last `step-K` marker in `text`.
fn step_marker(text: &str) -> Option<usize> {
    text.match_indices("step-")
        .filter_map(|(i, m)| {
            let digits: String = text[i + m.len()..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            digits.parse().ok()
        })
        .last()
}

/// The tools of a request as `(name, JSON schema of the arguments)`.
fn tools(api: Api, body: &Value) -> Vec<(String, Value)> {
    if api == Api::Gemini {
        // Gemini: tools are groups of `functionDeclarations`.
        return body["tools"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|t| t["functionDeclarations"].as_array().into_iter().flatten())
            .filter_map(|f| {
                let schema = f.get("parametersJsonSchema").unwrap_or(&f["parameters"]);
                Some((f["name"].as_str()?.to_owned(), schema.clone()))
            })
            .collect();
    }
    body["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| {
            let (name, schema) = match api {
                Api::Messages => (t["name"].as_str()?, &t["input_schema"]),
                Api::Responses => (t["name"].as_str()?, &t["parameters"]),
                Api::Chat => (
                    t["function"]["name"].as_str()?,
                    &t["function"]["parameters"],
                ),
                Api::Gemini => return None,
            };
            Some((name.to_owned(), schema.clone()))
        })
        .collect()
}

/// The agent's shell tool and the arguments that run `command` with it: the first tool named
/// `bash`, `exec_command`, `shell` or `run_shell_command` (any case), its arguments built
/// from its schema (`cmd` or `command`, a string or an argv array, and a `description` when it
/// has one).
fn shell_call(tools: &[(String, Value)], command: &str, k: usize) -> Option<(String, Value)> {
    let (name, schema) = ["bash", "exec_command", "shell", "run_shell_command"]
        .iter()
        .find_map(|wanted| {
            tools
                .iter()
                .find(|(name, _)| name.eq_ignore_ascii_case(wanted))
        })?;
    let props = &schema["properties"];
    let mut args = serde_json::Map::new();
    let key = if props.get("cmd").is_some() {
        "cmd"
    } else {
        "command"
    };
    let value = if props[key]["type"] == "array" {
        json!(["bash", "-lc", command])
    } else {
        json!(command)
    };
    args.insert(key.into(), value);
    if props.get("description").is_some() {
        args.insert("description".into(), json!(format!("Scripted step {k}")));
    }
    Some((name.clone(), Value::Object(args)))
}

/// Requests the prompt cache remembers.
const CACHED_REQUESTS: usize = 8;

/// A request as the provider renders its prompt, and caches it: tool definitions, then the
/// system prompt or instructions, then the conversation, whatever the order of the JSON keys.
fn rendered(body: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    for key in ["tools", "system", "instructions", "systemInstruction"] {
        if let Some(v) = body.get(key) {
            out.extend(v.to_string().into_bytes());
        }
    }
    for key in ["messages", "input", "contents"] {
        match body.get(key) {
            Some(Value::Array(items)) => {
                for item in items {
                    out.extend(item.to_string().into_bytes());
                }
            }
            Some(other) => out.extend(other.to_string().into_bytes()),
            None => {}
        }
    }
    out
}

/// The provider's prompt cache, as OpenAI's automatic prefix caching works (and Anthropic's
/// with a breakpoint on the latest message, as Claude Code sets it): of a request
/// ([`rendered`]), the tokens (four bytes each, as the request is counted) it shares from its
/// start with one of the latest requests, in 128-token steps from 1,024 on. Remembers it.
fn cached_tokens(state: &State, body: &[u8]) -> usize {
    let mut recent = state.recent.lock().unwrap_or_else(|e| e.into_inner());
    let shared = recent
        .iter()
        .map(|b| b.iter().zip(body).take_while(|(x, y)| x == y).count())
        .max()
        .unwrap_or(0);
    if recent.len() == CACHED_REQUESTS {
        recent.remove(0);
    }
    recent.push(body.to_vec());
    let tokens = shared / 4;
    if tokens < 1_024 {
        0
    } else {
        tokens / 128 * 128
    }
}

/// What the session's next answer is.
enum Turn {
    /// Run this command with the shell tool (step `k`).
    Call { k: usize, command: String },
    /// Say this and stop.
    Say(String),
}

fn chat(state: &State, req: &Recorded, api: Api, exchange: &mut Exchange) -> Reply {
    let body: Value = match serde_json::from_slice(&req.body) {
        Ok(v) => v,
        Err(e) => {
            let r = Rejection::Invalid(format!("invalid JSON: {e}"));
            exchange.answer = Answer::Refused(r.clone());
            return rejection(api, &r);
        }
    };
    let script = &state.script;
    if let Err(r) = check(api, &body, script.window) {
        exchange.answer = Answer::Refused(r.clone());
        return rejection(api, &r);
    }
    let n = state.next.fetch_add(1, Ordering::SeqCst);
    // Gemini names the model in the path (`…/models/{model}:verb`) and streams by its verb.
    let path_model = req
        .path()
        .rsplit_once(':')
        .and_then(|(prefix, _)| prefix.rsplit_once("/models/"))
        .map(|(_, model)| model.to_owned());
    let model = match (api, path_model) {
        (Api::Gemini, Some(model)) => model,
        _ => body["model"].as_str().unwrap_or(&script.model).to_owned(),
    };
    let stream = body["stream"] == true || req.path().ends_with(":streamGenerateContent");
    let tools = tools(api, &body);
    let input_tokens = req.body.len().div_ceil(4);
    let cached_tokens = cached_tokens(state, &rendered(&body)).min(input_tokens);
    let r = Responder {
        api,
        n,
        model: &model,
        stream,
        input_tokens,
        cached_tokens,
        thinking: matches!(
            body["thinking"]["type"].as_str(),
            Some("enabled" | "adaptive")
        ),
        usage_chunk: body["stream_options"]["include_usage"] == true,
    };
    if tools.is_empty() {
        exchange.answer = Answer::Side;
        return r.text("Scripted session");
    }
    if asks_for_summary(api, &body) {
        // compactor's summary asked inside the conversation: a model told to stop and
        // summarise (and, on OpenAI's APIs, offered no tool) answers with text.
        exchange.answer = Answer::Side;
        return r.text("Scripted summary: the shell steps ran, each printing its marker.");
    }
    let done = match last_tool_result(api, &body) {
        None => 0,
        Some(text) => match step_marker(&text) {
            Some(k) => k,
            None => {
                exchange.anomaly = Some(format!(
                    "the last tool result has no step marker: {:?}",
                    text.chars().take(300).collect::<String>()
                ));
                script.turns
            }
        },
    };
    let turn = if done < script.turns {
        let k = done + 1;
        exchange.answer = Answer::Step(k);
        Turn::Call {
            k,
            command: step_command(k, script.filler_lines),
        }
    } else {
        exchange.answer = Answer::Final;
        match &script.finish {
            Finish::Text => Turn::Say(final_text(script.turns)),
            Finish::Command(c) => Turn::Call {
                k: script.turns + 1,
                command: c.clone(),
            },
        }
    };
    match turn {
        Turn::Say(text) => r.text(&text),
        Turn::Call { k, command } => match shell_call(&tools, &command, k) {
            Some((name, args)) => r.call(&format!("Running step {k}."), &name, &args),
            None => {
                let names: Vec<&str> = tools.iter().map(|(n, _)| n.as_str()).collect();
                exchange.anomaly = Some(format!("no shell tool among {names:?}"));
                r.text("No shell tool was offered.")
            }
        },
    }
}

/// Writes one answer in the request's API and form (streamed or not).
struct Responder<'a> {
    api: Api,
    n: usize,
    model: &'a str,
    stream: bool,
    input_tokens: usize,
    /// Of `input_tokens`, those read from the prompt cache.
    cached_tokens: usize,
    /// Messages: the request enables thinking, so the answer opens with a thinking block.
    thinking: bool,
    /// Chat Completions: `stream_options.include_usage`.
    usage_chunk: bool,
}

const OUTPUT_TOKENS: usize = 24;
const SIGNATURE: &str = "c2NyaXB0ZWQtdGhpbmtpbmctc2lnbmF0dXJl";
const ENCRYPTED: &str = "gAAAAABzY3JpcHRlZC1yZWFzb25pbmc=";

impl Responder<'_> {
    fn text(&self, text: &str) -> Reply {
        match self.api {
            Api::Messages => self.messages(text, None),
            Api::Responses => self.responses(text, None),
            Api::Chat => self.chat(text, None),
            Api::Gemini => self.gemini(text, None),
        }
    }

    fn call(&self, text: &str, name: &str, args: &Value) -> Reply {
        match self.api {
            Api::Messages => self.messages(text, Some((name, args))),
            Api::Responses => self.responses(text, Some((name, args))),
            Api::Chat => self.chat(text, Some((name, args))),
            Api::Gemini => self.gemini(text, Some((name, args))),
        }
    }

    /// Gemini: a `GenerateContentResponse` (streamed: one per SSE event, the text in two
    /// chunks, then the call with a thought signature, the finish and the usage).
    fn gemini(&self, text: &str, call: Option<(&str, &Value)>) -> Reply {
        let usage = json!({"promptTokenCount": self.input_tokens,
                           "candidatesTokenCount": OUTPUT_TOKENS,
                           "totalTokenCount": self.input_tokens + OUTPUT_TOKENS,
                           "cachedContentTokenCount": self.cached_tokens});
        let response = |parts: Value, last: bool| {
            let mut candidate = json!({"content": {"parts": parts, "role": "model"}, "index": 0});
            let mut r = json!({"modelVersion": self.model,
                               "responseId": format!("scripted-{:04}", self.n)});
            if last {
                candidate["finishReason"] = json!("STOP");
                r["usageMetadata"] = usage.clone();
            }
            r["candidates"] = json!([candidate]);
            r
        };
        let call_part = call.map(|(name, args)| {
            json!({"functionCall": {"name": name, "args": args}, "thoughtSignature": SIGNATURE})
        });
        if !self.stream {
            let mut parts = vec![json!({"text": text})];
            parts.extend(call_part);
            return Reply::json(200, &response(json!(parts), true));
        }
        let (head, tail) = split_half(text);
        let mut events = vec![response(json!([{"text": head}]), false)];
        match call_part {
            Some(part) => {
                events.push(response(json!([{"text": tail}]), false));
                events.push(response(json!([part]), true));
            }
            None => events.push(response(json!([{"text": tail}]), true)),
        }
        Reply::Chunks {
            status: 200,
            headers: vec![("content-type".into(), "text/event-stream".into())],
            chunks: events
                .iter()
                .map(|e| Bytes::from(format!("data: {e}\r\n\r\n")))
                .collect(),
        }
    }

    fn messages(&self, text: &str, call: Option<(&str, &Value)>) -> Reply {
        let id = format!("msg_{:04}", self.n);
        let tool_id = format!("toolu_{:04}", self.n);
        let thought = format!("Following the script, answer {}.", self.n);
        let stop = if call.is_some() {
            "tool_use"
        } else {
            "end_turn"
        };
        let usage = json!({"input_tokens": 0,
                           "cache_creation_input_tokens": self.input_tokens - self.cached_tokens,
                           "cache_read_input_tokens": self.cached_tokens,
                           "output_tokens": OUTPUT_TOKENS, "service_tier": "standard"});
        if !self.stream {
            let mut content = Vec::new();
            if self.thinking {
                content
                    .push(json!({"type": "thinking", "thinking": thought, "signature": SIGNATURE}));
            }
            content.push(json!({"type": "text", "text": text}));
            if let Some((name, args)) = call {
                content
                    .push(json!({"type": "tool_use", "id": tool_id, "name": name, "input": args}));
            }
            return Reply::json(
                200,
                &json!({"id": id, "type": "message", "role": "assistant", "model": self.model,
                        "content": content, "stop_reason": stop, "stop_sequence": null,
                        "usage": usage}),
            )
            .with_header("request-id", &format!("req_{id}"));
        }
        let mut start_usage = usage.clone();
        start_usage["output_tokens"] = json!(1);
        let mut events = vec![(
            "message_start",
            json!({"type": "message_start", "message": {
                "id": id, "type": "message", "role": "assistant", "model": self.model,
                "content": [], "stop_reason": null, "stop_sequence": null, "usage": start_usage}}),
        )];
        let mut index = 0;
        if self.thinking {
            events.extend([
                (
                    "content_block_start",
                    json!({"type": "content_block_start", "index": index,
                           "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
                ),
                (
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": index,
                           "delta": {"type": "thinking_delta", "thinking": thought}}),
                ),
                (
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": index,
                           "delta": {"type": "signature_delta", "signature": SIGNATURE}}),
                ),
                (
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": index}),
                ),
            ]);
            index += 1;
        }
        events.push(("ping", json!({"type": "ping"})));
        let (head, tail) = split_half(text);
        events.push((
            "content_block_start",
            json!({"type": "content_block_start", "index": index,
                   "content_block": {"type": "text", "text": ""}}),
        ));
        for piece in [head, tail] {
            events.push((
                "content_block_delta",
                json!({"type": "content_block_delta", "index": index,
                       "delta": {"type": "text_delta", "text": piece}}),
            ));
        }
        events.push((
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        ));
        index += 1;
        if let Some((name, args)) = call {
            let json = args.to_string();
            let (head, tail) = split_half(&json);
            events.push((
                "content_block_start",
                json!({"type": "content_block_start", "index": index,
                       "content_block": {"type": "tool_use", "id": tool_id, "name": name, "input": {}}}),
            ));
            for piece in ["", head, tail] {
                events.push((
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": index,
                           "delta": {"type": "input_json_delta", "partial_json": piece}}),
                ));
            }
            events.push((
                "content_block_stop",
                json!({"type": "content_block_stop", "index": index}),
            ));
        }
        events.push((
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": null},
                   "usage": {"input_tokens": 0,
                             "cache_creation_input_tokens": self.input_tokens - self.cached_tokens,
                             "cache_read_input_tokens": self.cached_tokens,
                             "output_tokens": OUTPUT_TOKENS}}),
        ));
        events.push(("message_stop", json!({"type": "message_stop"})));
        named_sse(&events).with_header("request-id", &format!("req_{id}"))
    }

    fn response_object(&self, status: &str, output: Value) -> Value {
        let usage = if status == "completed" {
            json!({"input_tokens": self.input_tokens,
                   "input_tokens_details": {"cached_tokens": self.cached_tokens},
                   "output_tokens": OUTPUT_TOKENS, "output_tokens_details": {"reasoning_tokens": 8},
                   "total_tokens": self.input_tokens + OUTPUT_TOKENS})
        } else {
            Value::Null
        };
        json!({"id": format!("resp_{:04}", self.n), "object": "response",
               "created_at": 1_700_000_000, "status": status, "background": false, "error": null,
               "incomplete_details": null, "instructions": null, "max_output_tokens": null,
               "model": self.model, "output": output, "parallel_tool_calls": true,
               "previous_response_id": null, "reasoning": {"effort": "medium", "summary": "auto"},
               "store": false, "temperature": 1.0, "text": {"format": {"type": "text"}},
               "tool_choice": "auto", "tools": [], "top_p": 1.0, "truncation": "disabled",
               "usage": usage, "metadata": {}})
    }

    fn responses(&self, text: &str, call: Option<(&str, &Value)>) -> Reply {
        let n = self.n;
        let reasoning = json!({"type": "reasoning", "id": format!("rs_{n}"),
                               "summary": [{"type": "summary_text", "text": format!("Following the script, answer {n}.")}],
                               "encrypted_content": ENCRYPTED});
        let message_id = format!("msg_{n}");
        let message = json!({"type": "message", "id": message_id, "status": "completed",
                             "role": "assistant",
                             "content": [{"type": "output_text", "text": text, "annotations": []}]});
        let function_call = call.map(|(name, args)| {
            json!({"type": "function_call", "id": format!("fc_{n}_0"),
                   "call_id": format!("call_{n}_0"), "name": name,
                   "arguments": args.to_string(), "status": "completed"})
        });
        // A call is answered with reasoning and the call; a text with reasoning and a message.
        let output: Vec<Value> = match &function_call {
            Some(fc) => vec![reasoning.clone(), fc.clone()],
            None => vec![reasoning.clone(), message.clone()],
        };
        if !self.stream {
            return Reply::json(200, &self.response_object("completed", json!(output)))
                .with_header("x-request-id", &format!("req_resp_{n}"));
        }
        let mut events = vec![
            (
                "response.created",
                json!({"type": "response.created", "response": self.response_object("in_progress", json!([]))}),
            ),
            (
                "response.in_progress",
                json!({"type": "response.in_progress", "response": self.response_object("in_progress", json!([]))}),
            ),
            (
                "response.output_item.added",
                json!({"type": "response.output_item.added", "output_index": 0,
                       "item": {"type": "reasoning", "id": format!("rs_{n}"), "summary": []}}),
            ),
            (
                "response.output_item.done",
                json!({"type": "response.output_item.done", "output_index": 0, "item": reasoning}),
            ),
        ];
        match &function_call {
            Some(fc) => {
                let item_id = fc["id"].clone();
                let arguments = fc["arguments"].as_str().unwrap_or("{}").to_owned();
                let (head, tail) = split_half(&arguments);
                let mut added = fc.clone();
                added["arguments"] = json!("");
                added["status"] = json!("in_progress");
                events.push((
                    "response.output_item.added",
                    json!({"type": "response.output_item.added", "output_index": 1, "item": added}),
                ));
                for piece in [head, tail] {
                    events.push((
                        "response.function_call_arguments.delta",
                        json!({"type": "response.function_call_arguments.delta", "item_id": item_id,
                               "output_index": 1, "delta": piece}),
                    ));
                }
                events.push((
                    "response.function_call_arguments.done",
                    json!({"type": "response.function_call_arguments.done", "item_id": item_id,
                           "output_index": 1, "arguments": arguments}),
                ));
                events.push((
                    "response.output_item.done",
                    json!({"type": "response.output_item.done", "output_index": 1, "item": fc}),
                ));
            }
            None => {
                let (head, tail) = split_half(text);
                events.push((
                    "response.output_item.added",
                    json!({"type": "response.output_item.added", "output_index": 1,
                           "item": {"type": "message", "id": message_id, "status": "in_progress",
                                    "role": "assistant", "content": []}}),
                ));
                events.push((
                    "response.content_part.added",
                    json!({"type": "response.content_part.added", "item_id": message_id,
                           "output_index": 1, "content_index": 0,
                           "part": {"type": "output_text", "text": "", "annotations": []}}),
                ));
                for piece in [head, tail] {
                    events.push((
                        "response.output_text.delta",
                        json!({"type": "response.output_text.delta", "item_id": message_id,
                               "output_index": 1, "content_index": 0, "delta": piece}),
                    ));
                }
                events.push((
                    "response.output_text.done",
                    json!({"type": "response.output_text.done", "item_id": message_id,
                           "output_index": 1, "content_index": 0, "text": text}),
                ));
                events.push((
                    "response.content_part.done",
                    json!({"type": "response.content_part.done", "item_id": message_id,
                           "output_index": 1, "content_index": 0,
                           "part": {"type": "output_text", "text": text, "annotations": []}}),
                ));
                events.push((
                    "response.output_item.done",
                    json!({"type": "response.output_item.done", "output_index": 1, "item": message}),
                ));
            }
        }
        events.push((
            "response.completed",
            json!({"type": "response.completed", "response": self.response_object("completed", json!(output))}),
        ));
        let events: Vec<(&str, Value)> = events
            .into_iter()
            .enumerate()
            .map(|(seq, (name, mut data))| {
                data["sequence_number"] = json!(seq);
                (name, data)
            })
            .collect();
        named_sse(&events).with_header("x-request-id", &format!("req_resp_{n}"))
    }

    fn chat(&self, text: &str, call: Option<(&str, &Value)>) -> Reply {
        let id = format!("chatcmpl-{:04}", self.n);
        let call_id = format!("call_{:04}", self.n);
        let finish = if call.is_some() { "tool_calls" } else { "stop" };
        let usage = json!({"prompt_tokens": self.input_tokens, "completion_tokens": OUTPUT_TOKENS,
                           "total_tokens": self.input_tokens + OUTPUT_TOKENS,
                           "prompt_tokens_details": {"cached_tokens": self.cached_tokens}});
        if !self.stream {
            let mut message = json!({"role": "assistant", "content": text, "refusal": null});
            if let Some((name, args)) = call {
                message["tool_calls"] = json!([{"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": args.to_string()}}]);
            }
            return Reply::json(
                200,
                &json!({"id": id, "object": "chat.completion", "created": 1_700_000_000,
                        "model": self.model, "system_fingerprint": "fp_scripted",
                        "choices": [{"index": 0, "message": message, "logprobs": null,
                                     "finish_reason": finish}],
                        "usage": usage}),
            )
            .with_header("x-request-id", &format!("req_{id}"));
        }
        let chunk = |choices: Value, usage: Value| {
            let mut c = json!({"id": id, "object": "chat.completion.chunk", "created": 1_700_000_000,
                               "model": self.model, "system_fingerprint": "fp_scripted",
                               "choices": choices});
            if self.usage_chunk {
                c["usage"] = usage;
            }
            c.to_string()
        };
        let delta = |d: Value| {
            chunk(
                json!([{"index": 0, "delta": d, "logprobs": null, "finish_reason": null}]),
                Value::Null,
            )
        };
        let (head, tail) = split_half(text);
        let mut events = vec![
            delta(json!({"role": "assistant", "content": "", "refusal": null})),
            delta(json!({"content": head})),
            delta(json!({"content": tail})),
        ];
        if let Some((name, args)) = call {
            let arguments = args.to_string();
            let (a, b) = split_half(&arguments);
            events.push(delta(json!({"tool_calls": [{"index": 0, "id": call_id, "type": "function",
                                                     "function": {"name": name, "arguments": ""}}]})));
            for piece in [a, b] {
                events.push(delta(
                    json!({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}),
                ));
            }
        }
        events.push(chunk(
            json!([{"index": 0, "delta": {}, "logprobs": null, "finish_reason": finish}]),
            Value::Null,
        ));
        if self.usage_chunk {
            events.push(chunk(json!([]), usage));
        }
        events.push("[DONE]".into());
        Reply::sse(&events).with_header("x-request-id", &format!("req_{id}"))
    }
}

/// `text` cut in two at a character boundary near its middle.
fn split_half(text: &str) -> (&str, &str) {
    let mut mid = text.len() / 2;
    while !text.is_char_boundary(mid) {
        mid += 1;
    }
    text.split_at(mid)
}

/// An SSE response of named events (`event:` and `data:` lines), as Anthropic and the
/// Responses API send them.
pub fn named_sse(events: &[(&str, Value)]) -> Reply {
    Reply::Chunks {
        status: 200,
        headers: vec![
            ("content-type".into(), "text/event-stream".into()),
            ("cache-control".into(), "no-cache".into()),
        ],
        chunks: events
            .iter()
            .map(|(name, data)| Bytes::from(format!("event: {name}\ndata: {data}\n\n")))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_and_shell_calls() {
        assert_eq!(step_marker("step-3\n300000\n"), Some(3));
        assert_eq!(step_marker("step-1 then step-12"), Some(12));
        assert_eq!(step_marker("no marker"), None);
        let tools = vec![
            ("Read".to_owned(), json!({"properties": {"file_path": {}}})),
            (
                "Bash".to_owned(),
                json!({"properties": {"command": {"type": "string"}, "description": {}}}),
            ),
        ];
        assert_eq!(
            shell_call(&tools, "ls", 2),
            Some((
                "Bash".into(),
                json!({"command": "ls", "description": "Scripted step 2"})
            ))
        );
        let codex = vec![(
            "exec_command".to_owned(),
            json!({"properties": {"cmd": {"type": "string"}}}),
        )];
        assert_eq!(
            shell_call(&codex, "ls", 1),
            Some(("exec_command".into(), json!({"cmd": "ls"})))
        );
    }
}
