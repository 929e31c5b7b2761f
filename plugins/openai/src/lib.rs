//! The `openai` summarizer: any OpenAI-compatible endpoint, through Chat Completions or the
//! Responses API.
//!
//! With nothing configured it asks the caller's own upstream (`upstream_base_url` +
//! `api_prefix`) with the caller's own model and credentials, so it works with zero
//! configuration. Each setting of [`OpenAiConfig`] overrides one of those.
//!
//! The wire API follows the request being compacted ([`Caller::api`]):
//!
//! - **Chat Completions** (and every other caller): `POST …/chat/completions` with the rendered
//!   compaction prompt as the user message behind a short system message ([`SYSTEM_PROMPT`]);
//!   the summary is `choices[0].message.content`.
//! - **Responses** callers: `POST …/responses` with `{"model", "instructions": SYSTEM_PROMPT,
//!   "input": [user message], "max_output_tokens", "store": false}`; the summary is the
//!   concatenated `output_text` parts of the `message` items of `output` (`reasoning` items are
//!   skipped). Some OpenAI-compatible endpoints serve only `/responses`. This holds with a
//!   configured `base_url` too: a Responses caller's summary goes to `{base_url}/responses`.
//!
//! A request carrying [`SummaryRequest::in_conversation`] is asked that way first when this
//! backend uses the caller's own upstream and model (no `base_url`, no `model`): the body is
//! sent as compactor built it, so the provider serves the conversation from its prompt cache.
//! A refusal of that shape or an answer without a summary (see
//! [`compactor_transport::standalone_may_succeed`]) is followed by the standalone prompt
//! within the same deadline.
//!
//! The request is right for the model on the first call: reasoning models (the o-series and
//! `gpt-5`, see [`is_reasoning_model`]) get `max_completion_tokens` instead of `max_tokens` on
//! Chat Completions, and never a `temperature`, which they reject unless it is the default.
//! Any other model that still answers 400 naming `max_tokens` (wanting `max_completion_tokens`)
//! or `temperature` gets the request re-sent once with the parameter adjusted, inside the same
//! deadline, as a safety net for model names the rule does not know.
//!
//! HTTP, timeouts and error mapping come from the shared `compactor-transport` crate.
//!
//! [`Caller::api`]: compactor_plugin_api::Caller::api
#![deny(missing_docs)]

use std::fmt;
use std::path::PathBuf;

use http::header::{HeaderName, AUTHORIZATION};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::time::Instant;

use compactor_plugin_api::{
    Api, BoxFuture, Caller, InvalidSetting, SummarizeError, Summarizer, Summary, SummaryRequest,
    SummaryUsage, DEFAULT_MAX_SUMMARY_BYTES,
};

use compactor_transport::{self as transport, output_budget, response_limit, Auth, HttpClient};

/// The system message sent with every summary request (the contract's, shared by every LLM
/// backend).
pub use compactor_plugin_api::SYSTEM_PROMPT;

/// `[summarizer.openai]` of compactor's configuration file: what a user writes (the key by
/// the name of the environment variable holding it), with its defaults and validation. The
/// app reads the variable and builds the backend with [`OpenAiSettings::config`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OpenAiSettings {
    /// Endpoint base (e.g. `https://openrouter.ai/api/v1`); unset: the request's own upstream.
    pub base_url: Option<String>,
    /// Model; unset: the request's own model.
    pub model: Option<String>,
    /// Environment variable holding the API key; unset: the caller's own `Authorization`.
    pub api_key_env: Option<String>,
    /// Output budget of the summary.
    pub max_tokens: u32,
    /// Sampling temperature; unset: the provider's default.
    pub temperature: Option<f64>,
}

impl Default for OpenAiSettings {
    fn default() -> Self {
        OpenAiSettings {
            base_url: None,
            model: None,
            api_key_env: None,
            max_tokens: 4_096,
            temperature: None,
        }
    }
}

impl OpenAiSettings {
    /// Whether the settings can make a backend.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        transport::check_base_url(self.base_url.as_deref())?;
        transport::check_max_tokens(self.max_tokens)
    }

    /// The backend's configuration: these settings, the key read from `api_key_env`, the
    /// extra TLS roots and the summary bound compactor uses everywhere.
    pub fn config(
        &self,
        api_key: Option<String>,
        ca_file: Option<PathBuf>,
        max_summary_bytes: usize,
    ) -> OpenAiConfig {
        OpenAiConfig {
            base_url: self.base_url.clone(),
            model: self.model.clone(),
            api_key,
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            ca_file,
            max_summary_bytes,
        }
    }
}

/// Settings of one `openai` backend. `Debug` never prints the key.
#[derive(Clone)]
pub struct OpenAiConfig {
    /// Endpoint base, e.g. `https://openrouter.ai/api/v1`; `None`: the caller's upstream and
    /// API prefix.
    pub base_url: Option<String>,
    /// Model; `None`: the request's own model.
    pub model: Option<String>,
    /// API key sent as `Authorization: Bearer`; `None`: the caller's own credentials.
    pub api_key: Option<String>,
    /// Output budget (capped further by [`SummaryRequest::max_output_tokens`]), sent as
    /// `max_tokens`, `max_completion_tokens` (reasoning models) or `max_output_tokens`
    /// (Responses API).
    pub max_tokens: u32,
    /// Sampling temperature; `None`: the provider's default. Never sent to reasoning models
    /// ([`is_reasoning_model`]): they reject any temperature but the default, so a configured
    /// one is left out for them.
    pub temperature: Option<f64>,
    /// Extra PEM roots trusted for `https` endpoints.
    pub ca_file: Option<PathBuf>,
    /// Longest summary accepted, in bytes. The provider's whole answer is read up to this plus
    /// [`SUMMARY_ENVELOPE_BYTES`](compactor_plugin_api::SUMMARY_ENVELOPE_BYTES) for the JSON
    /// around the summary and refused beyond, unread ([`SummarizeError::TooLarge`]); so is a
    /// longer summary inside a smaller answer.
    pub max_summary_bytes: usize,
}

/// Nothing configured (the caller's endpoint, model and credentials; no output budget of its
/// own), with the default summary bound.
impl Default for OpenAiConfig {
    fn default() -> Self {
        OpenAiConfig {
            base_url: None,
            model: None,
            api_key: None,
            max_tokens: 0,
            temperature: None,
            ca_file: None,
            max_summary_bytes: DEFAULT_MAX_SUMMARY_BYTES,
        }
    }
}

impl fmt::Debug for OpenAiConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenAiConfig")
            .field("base_url", &self.base_url)
            .field("model", &self.model)
            .field("api_key", &self.api_key.as_ref().map(|_| "[redacted]"))
            .field("max_tokens", &self.max_tokens)
            .field("temperature", &self.temperature)
            .field("ca_file", &self.ca_file)
            .field("max_summary_bytes", &self.max_summary_bytes)
            .finish()
    }
}

/// The `openai` backend. One instance owns one connection pool.
#[derive(Debug)]
pub struct OpenAiSummarizer {
    config: OpenAiConfig,
    http: HttpClient,
}

impl OpenAiSummarizer {
    /// Builds the backend and its HTTP client.
    pub fn new(config: OpenAiConfig) -> Result<OpenAiSummarizer, SummarizeError> {
        let http = HttpClient::new(config.ca_file.as_deref())?
            .with_max_response_bytes(response_limit(config.max_summary_bytes));
        Ok(OpenAiSummarizer { config, http })
    }

    /// The endpoint a request goes to: `…/responses` for a Responses caller, else
    /// `…/chat/completions`, on the configured `base_url` or else the caller's upstream and
    /// API prefix.
    pub fn endpoint(&self, caller: &Caller) -> Result<String, SummarizeError> {
        transport::endpoint(
            self.config.base_url.as_deref(),
            caller,
            "",
            Wire::of(caller.api).path(),
        )
    }

    async fn run(&self, request: &SummaryRequest) -> Result<Summary, SummarizeError> {
        let deadline = Instant::now() + request.timeout;
        let wire = Wire::of(request.caller.api);
        let url = self.endpoint(&request.caller)?;
        let model = transport::model(self.config.model.as_deref(), request)?;
        let auth = self.auth(&request.caller)?;
        let exchange = Exchange {
            url: &url,
            auth: &auth,
            wire,
            model,
            deadline,
            timeout: request.timeout,
        };
        transport::inside_first(
            "openai",
            self.in_conversation(request),
            || Ok(self.body(wire, model, request)),
            |body| self.ask(&exchange, body),
        )
        .await
    }

    /// The request asking for the summary inside the conversation, when this backend sends it:
    /// only to the caller's own upstream with the caller's own model (anywhere else the
    /// provider has nothing cached), and only one it can parse.
    fn in_conversation(&self, request: &SummaryRequest) -> Option<Value> {
        if !self.reads_conversation(request.caller.api) {
            return None;
        }
        serde_json::from_slice(request.in_conversation.as_deref()?).ok()
    }

    /// Sends one summary request and reads the summary from the answer; a 400 naming a
    /// parameter the model does not take is answered by re-sending once without it.
    async fn ask(&self, x: &Exchange<'_>, mut body: Value) -> Result<Summary, SummarizeError> {
        let secrets = x.auth.secret_refs();
        let mut adjusted = false;
        let answer = loop {
            match self
                .http
                .post_json(
                    x.url,
                    &x.auth.headers,
                    &body,
                    &secrets,
                    x.deadline,
                    x.timeout,
                )
                .await
            {
                Err(SummarizeError::Status {
                    status: 400,
                    message,
                }) if !adjusted && adjust_rejected_parameter(&mut body, &message) => {
                    tracing::debug!(backend = "openai", "retrying with adjusted parameters");
                    adjusted = true;
                }
                other => break other?,
            }
        };
        let text = match x.wire {
            Wire::ChatCompletions => message_content(&answer)?,
            Wire::Responses => output_text(&answer)?,
        };
        Ok(
            Summary::bounded(text.trim(), self.config.max_summary_bytes)?
                .with_usage(usage(&answer, x.model)),
        )
    }

    /// The JSON body of one summary request to `model` over `wire`.
    fn body(&self, wire: Wire, model: &str, request: &SummaryRequest) -> Value {
        let budget = output_budget(self.config.max_tokens, request.max_output_tokens);
        let reasoning = is_reasoning_model(model);
        let mut body = match wire {
            Wire::ChatCompletions => {
                let budget_key = if reasoning {
                    "max_completion_tokens"
                } else {
                    "max_tokens"
                };
                json!({
                    "model": model,
                    "messages": [
                        {"role": "system", "content": SYSTEM_PROMPT},
                        {"role": "user", "content": request.prompt},
                    ],
                    budget_key: budget,
                    "stream": false,
                })
            }
            Wire::Responses => json!({
                "model": model,
                "instructions": SYSTEM_PROMPT,
                "input": [{"role": "user", "content": request.prompt}],
                "max_output_tokens": budget,
                "store": false,
            }),
        };
        match self.config.temperature {
            Some(t) if !reasoning => body["temperature"] = json!(t),
            Some(_) => tracing::debug!(
                backend = "openai",
                model,
                "temperature not sent: reasoning models accept only the default"
            ),
            None => {}
        }
        body
    }

    /// The credential headers: the configured key, else the caller's `authorization` (and
    /// `api-key`, Azure style).
    fn auth(&self, caller: &Caller) -> Result<Auth, SummarizeError> {
        let mut auth = Auth::default();
        if let Some(key) = &self.config.api_key {
            auth.add(AUTHORIZATION, &format!("Bearer {key}"), &[key])?;
            return Ok(auth);
        }
        if let Some(value) = caller.credential("authorization") {
            auth.add_bearer(AUTHORIZATION, value)?;
        }
        if let Some(key) = caller.credential("api-key") {
            auth.add(HeaderName::from_static("api-key"), key, &[key])?;
        }
        Ok(auth)
    }
}

impl Summarizer for OpenAiSummarizer {
    fn name(&self) -> &str {
        "openai"
    }

    fn summarize<'a>(
        &'a self,
        request: &'a SummaryRequest,
    ) -> BoxFuture<'a, Result<Summary, SummarizeError>> {
        Box::pin(self.run(request))
    }

    /// The configured `max_tokens`, whatever the API (it is the budget of the Chat
    /// Completions and the Responses request alike).
    fn max_output_tokens(&self, api: Api) -> Option<u32> {
        let _ = api;
        (self.config.max_tokens > 0).then_some(self.config.max_tokens)
    }

    /// With no `base_url` and no `model` of its own, for Chat Completions and Responses
    /// callers.
    fn reads_conversation(&self, api: Api) -> bool {
        self.config.base_url.is_none()
            && self.config.model.is_none()
            && matches!(api, Api::ChatCompletions | Api::Responses)
    }
}

/// Where and how one summary is asked for.
struct Exchange<'a> {
    url: &'a str,
    auth: &'a Auth,
    wire: Wire,
    model: &'a str,
    deadline: Instant,
    timeout: std::time::Duration,
}

/// The wire API a summary request is sent with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wire {
    /// `POST …/chat/completions`.
    ChatCompletions,
    /// `POST …/responses`.
    Responses,
}

impl Wire {
    /// Responses for Responses callers; Chat Completions for everyone else (including an
    /// Anthropic Messages caller when `openai` is chosen explicitly).
    fn of(api: Api) -> Wire {
        match api {
            Api::Responses => Wire::Responses,
            Api::ChatCompletions | Api::Messages | Api::Gemini => Wire::ChatCompletions,
        }
    }

    /// The path after the base URL and API prefix.
    fn path(self) -> &'static str {
        match self {
            Wire::ChatCompletions => "chat/completions",
            Wire::Responses => "responses",
        }
    }
}

/// Whether `model` is an OpenAI reasoning model: the o-series (`o1`, `o3-mini`, `o4-mini`,
/// `o1-2024-12-17`, ...) or the `gpt-5` family (`gpt-5`, `gpt-5-mini`, `gpt-5.1`,
/// `gpt-5-2025-08-07`, ...), case-insensitively, after any provider prefix (`openai/o3-mini`,
/// `azure/openai/gpt-5`) and a fine-tune's `ft:`.
///
/// These models want `max_completion_tokens` instead of `max_tokens` on Chat Completions and
/// reject a non-default `temperature`, so from the first call they get `max_completion_tokens`
/// and no `temperature` (on the Responses API the budget is `max_output_tokens` for every
/// model; only the temperature differs). Names this rule does not know (an Azure deployment
/// name, say) still get the parameters adjusted after a 400 that names them.
pub fn is_reasoning_model(model: &str) -> bool {
    let name = model.rsplit('/').next().unwrap_or(model).trim();
    let name = name.to_ascii_lowercase();
    let name = name.strip_prefix("ft:").unwrap_or(&name);
    // The family ends at the end of the name or at a separator (`-`, `.`, `:`, ...).
    let family_ends = |rest: &str| !rest.starts_with(|c: char| c.is_ascii_alphanumeric());
    if let Some(rest) = name.strip_prefix('o') {
        let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        if digits > 0 && family_ends(&rest[digits..]) {
            return true;
        }
    }
    name.strip_prefix("gpt-5").is_some_and(family_ends)
}

/// Rewrites `body` after a 400 naming a parameter the model does not support; `true` when
/// something changed and the request is worth re-sending.
fn adjust_rejected_parameter(body: &mut Value, message: &str) -> bool {
    let Some(obj) = body.as_object_mut() else {
        return false;
    };
    let mut changed = false;
    if message.contains("max_completion_tokens") {
        if let Some(n) = obj.remove("max_tokens") {
            obj.insert("max_completion_tokens".into(), n);
            changed = true;
        }
    }
    if message.contains("temperature") && obj.remove("temperature").is_some() {
        changed = true;
    }
    changed
}

/// `choices[0].message.content` as text (a string, or the `text` of an array of parts).
fn message_content(answer: &Value) -> Result<String, SummarizeError> {
    let message = &answer["choices"][0]["message"];
    match &message["content"] {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => Ok(parts
            .iter()
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .join("")),
        _ => match message["refusal"].as_str() {
            Some(r) => Err(SummarizeError::InvalidOutput(format!(
                "the model refused: {}",
                transport::bounded(r, transport::MAX_ERROR_MESSAGE_CHARS)
            ))),
            None => Err(SummarizeError::InvalidOutput(
                "response has no choices[0].message.content".into(),
            )),
        },
    }
}

/// What an answer's `usage` billed: Chat Completions (`prompt_tokens`, `completion_tokens`,
/// `prompt_tokens_details.cached_tokens`) or Responses (`input_tokens`, `output_tokens`,
/// `input_tokens_details.cached_tokens`); the model the answer names, else the one asked for.
/// `None` without a usage object.
fn usage(answer: &Value, asked: &str) -> Option<SummaryUsage> {
    let u = answer.get("usage").filter(|u| u.is_object())?;
    let n = |v: &Value| v.as_u64().unwrap_or(0);
    let chat = u.get("prompt_tokens").is_some();
    let (input, output, details) = if chat {
        (
            "prompt_tokens",
            "completion_tokens",
            "prompt_tokens_details",
        )
    } else {
        ("input_tokens", "output_tokens", "input_tokens_details")
    };
    Some(SummaryUsage {
        model: answer["model"].as_str().unwrap_or(asked).to_string(),
        input: n(&u[input]),
        output: n(&u[output]),
        cache_read: n(&u[details]["cached_tokens"]),
        cache_write: 0,
    })
}

/// The summary of a Responses API answer: the `text` of every `output_text` part of every
/// `message` item of `output`, concatenated (`reasoning` and other items skipped).
fn output_text(answer: &Value) -> Result<String, SummarizeError> {
    let Some(items) = answer["output"].as_array() else {
        // Some compatible servers add the SDK's convenience field; accept it alone too.
        if let Some(text) = answer["output_text"].as_str() {
            return Ok(text.to_owned());
        }
        return Err(SummarizeError::InvalidOutput(
            "response has no `output` array".into(),
        ));
    };
    let parts: Vec<&Value> = items
        .iter()
        .filter(|item| item["type"] == "message")
        .filter_map(|item| item["content"].as_array())
        .flatten()
        .collect();
    let texts: Vec<&str> = parts
        .iter()
        .filter(|p| p["type"] == "output_text")
        .filter_map(|p| p["text"].as_str())
        .collect();
    if !texts.is_empty() {
        return Ok(texts.concat());
    }
    if let Some(refusal) = parts
        .iter()
        .filter(|p| p["type"] == "refusal")
        .find_map(|p| p["refusal"].as_str())
    {
        return Err(SummarizeError::InvalidOutput(format!(
            "the model refused: {}",
            transport::bounded(refusal, transport::MAX_ERROR_MESSAGE_CHARS)
        )));
    }
    let status = answer["status"].as_str().unwrap_or("unknown");
    let reason = answer["incomplete_details"]["reason"]
        .as_str()
        .or_else(|| answer["error"]["message"].as_str())
        .map(|r| {
            format!(
                " ({})",
                transport::bounded(r, transport::MAX_ERROR_MESSAGE_CHARS)
            )
        })
        .unwrap_or_default();
    Err(SummarizeError::InvalidOutput(format!(
        "response has no output_text (status {status}{reason})"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_read_from_chat_and_responses_answers() {
        let chat = json!({"model": "gpt-5-mini", "usage": {"prompt_tokens": 900, "completion_tokens": 80,
            "prompt_tokens_details": {"cached_tokens": 512}}});
        let u = usage(&chat, "asked").expect("usage");
        assert_eq!(
            (
                u.model.as_str(),
                u.input,
                u.output,
                u.cache_read,
                u.cache_write
            ),
            ("gpt-5-mini", 900, 80, 512, 0)
        );
        let responses = json!({"usage": {"input_tokens": 700, "output_tokens": 60,
            "input_tokens_details": {"cached_tokens": 0}}});
        let u = usage(&responses, "asked").expect("usage");
        assert_eq!((u.model.as_str(), u.input, u.output), ("asked", 700, 60));
        assert_eq!(usage(&json!({"choices": []}), "asked"), None);
        assert_eq!(usage(&json!({"usage": null}), "asked"), None);
    }

    #[test]
    fn rejected_parameters_are_adjusted_once() {
        let mut body = json!({"max_tokens": 10, "temperature": 0.2});
        let msg = "Unsupported parameter: 'max_tokens' is not supported with this model. \
                   Use 'max_completion_tokens' instead.";
        assert!(adjust_rejected_parameter(&mut body, msg));
        assert_eq!(
            body,
            json!({"max_completion_tokens": 10, "temperature": 0.2})
        );
        assert!(!adjust_rejected_parameter(&mut body, msg));
        assert!(adjust_rejected_parameter(
            &mut body,
            "Unsupported value: 'temperature'"
        ));
        assert!(!adjust_rejected_parameter(
            &mut body,
            "context length exceeded"
        ));
    }

    #[test]
    fn content_is_read_from_strings_or_parts() {
        let a = json!({"choices":[{"message":{"content":"hi"}}]});
        assert_eq!(message_content(&a).ok().as_deref(), Some("hi"));
        let b = json!({"choices":[{"message":{"content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}}]});
        assert_eq!(message_content(&b).ok().as_deref(), Some("ab"));
        let c = json!({"choices":[]});
        assert!(matches!(
            message_content(&c),
            Err(SummarizeError::InvalidOutput(_))
        ));
    }

    #[test]
    fn reasoning_models_are_recognised_by_family() {
        for model in [
            "o1",
            "o1-mini",
            "o1-2024-12-17",
            "o3",
            "o3-mini",
            "o3-pro",
            "o4-mini",
            "o4-mini-2025-04-16",
            "O3-Mini",
            "openai/o3-mini",
            "openai/o4-mini",
            "azure/openai/o1",
            "ft:o4-mini-2025-04-16:acme::abc123",
            "gpt-5",
            "gpt-5-mini",
            "gpt-5-nano",
            "gpt-5-2025-08-07",
            "gpt-5.1",
            "gpt-5.1-codex",
            "openai/gpt-5-mini",
            "gpt-5:online",
        ] {
            assert!(is_reasoning_model(model), "{model} is a reasoning model");
        }
        for model in [
            "gpt-4o",
            "gpt-4o-mini",
            "gpt-4.1",
            "gpt-4-turbo",
            "gpt-3.5-turbo",
            "openai/gpt-4o",
            "omni-moderation-latest",
            "o",
            "oss-20b",
            "o3x",
            "gpt-50",
            "gpt-5o",
            "claude-sonnet-4-5",
            "my-o3-deployment",
            "",
        ] {
            assert!(
                !is_reasoning_model(model),
                "{model} is not a reasoning model"
            );
        }
    }

    #[test]
    fn responses_output_text_skips_reasoning_and_concatenates() {
        let a = json!({"output": [
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "thinking"}]},
            {"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "a", "annotations": []},
                {"type": "output_text", "text": "b", "annotations": []}
            ]},
            {"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "c", "annotations": []}
            ]}
        ]});
        assert_eq!(output_text(&a).ok().as_deref(), Some("abc"));
        let refused = json!({"output": [{"type": "message", "content": [
            {"type": "refusal", "refusal": "I can't help with that."}
        ]}]});
        assert!(matches!(
            output_text(&refused),
            Err(SummarizeError::InvalidOutput(m)) if m.contains("I can't help with that.")
        ));
        let incomplete = json!({"status": "incomplete",
            "incomplete_details": {"reason": "max_output_tokens"},
            "output": [{"type": "reasoning", "id": "rs_1", "summary": []}]});
        assert!(matches!(
            output_text(&incomplete),
            Err(SummarizeError::InvalidOutput(m)) if m.contains("max_output_tokens")
        ));
        assert!(matches!(
            output_text(&json!({"choices": []})),
            Err(SummarizeError::InvalidOutput(_))
        ));
        assert_eq!(
            output_text(&json!({"output_text": "x"})).ok().as_deref(),
            Some("x")
        );
    }

    #[test]
    fn endpoints_follow_the_callers_api_and_the_config() {
        let s = |base: Option<&str>| {
            OpenAiSummarizer::new(OpenAiConfig {
                base_url: base.map(str::to_owned),
                ..Default::default()
            })
            .expect("build")
        };
        let caller = |api| Caller {
            upstream_base_url: "https://gw.example".into(),
            api_prefix: "/v1".into(),
            api,
            ..Caller::default()
        };
        let at = |base, api| s(base).endpoint(&caller(api)).ok();
        assert_eq!(
            at(None, Api::ChatCompletions).as_deref(),
            Some("https://gw.example/v1/chat/completions")
        );
        assert_eq!(
            at(None, Api::Responses).as_deref(),
            Some("https://gw.example/v1/responses")
        );
        assert_eq!(
            at(None, Api::Messages).as_deref(),
            Some("https://gw.example/v1/chat/completions")
        );
        let base = Some("https://openrouter.ai/api/v1/");
        assert_eq!(
            at(base, Api::ChatCompletions).as_deref(),
            Some("https://openrouter.ai/api/v1/chat/completions")
        );
        assert_eq!(
            at(base, Api::Responses).as_deref(),
            Some("https://openrouter.ai/api/v1/responses")
        );
    }

    #[test]
    fn max_output_tokens_is_the_configured_budget() {
        let s = |max_tokens| {
            OpenAiSummarizer::new(OpenAiConfig {
                max_tokens,
                ..Default::default()
            })
            .expect("build")
        };
        for api in [Api::ChatCompletions, Api::Responses, Api::Messages] {
            assert_eq!(s(1234).max_output_tokens(api), Some(1234));
            assert_eq!(
                s(0).max_output_tokens(api),
                None,
                "0 means no budget of its own"
            );
        }
    }

    #[test]
    fn settings_default_validate_and_make_the_config() {
        let settings = OpenAiSettings::default();
        assert_eq!(settings.max_tokens, 4_096);
        assert_eq!(settings.validate(), Ok(()));
        for (bad, key) in [
            (
                OpenAiSettings {
                    base_url: Some("ftp://x".into()),
                    ..OpenAiSettings::default()
                },
                "base_url",
            ),
            (
                OpenAiSettings {
                    base_url: Some("https://x/v1?k=1".into()),
                    ..OpenAiSettings::default()
                },
                "base_url",
            ),
            (
                OpenAiSettings {
                    max_tokens: 0,
                    ..OpenAiSettings::default()
                },
                "max_tokens",
            ),
        ] {
            assert_eq!(bad.validate().map_err(|e| e.key), Err(key), "{bad:?}");
        }
        let config = OpenAiSettings {
            model: Some("m".into()),
            temperature: Some(0.5),
            ..OpenAiSettings::default()
        }
        .config(Some("sk".into()), None, 10);
        assert_eq!(
            (
                config.model.as_deref(),
                config.api_key.as_deref(),
                config.temperature
            ),
            (Some("m"), Some("sk"), Some(0.5))
        );
        assert_eq!((config.max_tokens, config.max_summary_bytes), (4_096, 10));
        // Only the caller's own upstream and model hold the conversation in their cache.
        let own = OpenAiSummarizer::new(OpenAiSettings::default().config(None, None, 10))
            .expect("builds");
        assert!(own.reads_conversation(Api::ChatCompletions));
        assert!(own.reads_conversation(Api::Responses));
        assert!(!own.reads_conversation(Api::Messages));
        let other = OpenAiSummarizer::new(config).expect("builds");
        assert!(!other.reads_conversation(Api::ChatCompletions));
    }

    #[test]
    fn debug_hides_the_key() {
        let c = OpenAiConfig {
            api_key: Some("sk-hidden".into()),
            ..Default::default()
        };
        assert!(!format!("{c:?}").contains("sk-hidden"));
    }
}
