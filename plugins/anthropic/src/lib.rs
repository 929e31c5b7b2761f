//! The `anthropic` summarizer: the Anthropic Messages API.
//!
//! POSTs `{"model", "max_tokens", "system", "messages": [{"role": "user", "content": prompt}]}`
//! to `{base_url}/v1/messages`, or with no `base_url` to the caller's own upstream
//! (`upstream_base_url` + `api_prefix` + `/messages`), and reads the concatenated `text` blocks
//! of `content`. Credentials: the configured key as `x-api-key`, else the caller's
//! `x-api-key`, else the caller's `authorization` (OAuth-style callers).
//!
//! A request carrying [`SummaryRequest::in_conversation`] is asked that way first when this
//! backend uses the caller's own upstream and model (no `base_url`, no `model`): the body is
//! sent as compactor built it (the conversation with the agent's `cache_control` markers, so
//! the provider reads it from its prompt cache), and a refusal of that shape or an answer
//! without a text block is followed by the standalone prompt within the same deadline.
//!
//! [`Summarizer::max_output_tokens`] answers the configured `max_tokens` (the most the request
//! asks for; it is capped further by the request's own budget).
//!
//! HTTP, timeouts and error mapping are shared with the `openai` backend through the
//! `compactor-transport` crate; the system prompt is the contract's
//! ([`compactor_plugin_api::SYSTEM_PROMPT`]).
#![deny(missing_docs)]

use std::fmt;
use std::path::PathBuf;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, AUTHORIZATION};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::time::Instant;

use compactor_plugin_api::{
    Api, BoxFuture, Caller, InvalidSetting, SummarizeError, Summarizer, Summary, SummaryRequest,
    SummaryUsage, DEFAULT_MAX_SUMMARY_BYTES,
};
use compactor_transport::{
    self as transport, join_url, output_budget, response_limit, Auth, HttpClient,
};

/// The system prompt sent with every summary request (the contract's, shared by every LLM
/// backend).
pub use compactor_plugin_api::SYSTEM_PROMPT;

/// `[summarizer.anthropic]` of compactor's configuration file: what a user writes (the key
/// by the name of the environment variable holding it), with its defaults and validation.
/// The app reads the variable and builds the backend with [`AnthropicSettings::config`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AnthropicSettings {
    /// Endpoint base; unset: the request's own upstream.
    pub base_url: Option<String>,
    /// Model; unset: the request's own model.
    pub model: Option<String>,
    /// Environment variable holding the API key; unset: the caller's own `x-api-key`.
    pub api_key_env: Option<String>,
    /// `anthropic-version` header.
    pub anthropic_version: String,
    /// Output budget of the summary.
    pub max_tokens: u32,
}

impl Default for AnthropicSettings {
    fn default() -> Self {
        AnthropicSettings {
            base_url: None,
            model: None,
            api_key_env: None,
            anthropic_version: "2023-06-01".into(),
            max_tokens: 4_096,
        }
    }
}

impl AnthropicSettings {
    /// Whether the settings can make a backend.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        transport::check_base_url(self.base_url.as_deref())?;
        transport::check_max_tokens(self.max_tokens)?;
        if HeaderValue::from_str(&self.anthropic_version).is_err()
            || self.anthropic_version.trim().is_empty()
        {
            return Err(InvalidSetting::new(
                "anthropic_version",
                "must be a version string such as `2023-06-01`",
            ));
        }
        Ok(())
    }

    /// The backend's configuration: these settings, the key read from `api_key_env`, the
    /// extra TLS roots and the summary bound compactor uses everywhere.
    pub fn config(
        &self,
        api_key: Option<String>,
        ca_file: Option<PathBuf>,
        max_summary_bytes: usize,
    ) -> AnthropicConfig {
        AnthropicConfig {
            base_url: self.base_url.clone(),
            model: self.model.clone(),
            api_key,
            anthropic_version: self.anthropic_version.clone(),
            max_tokens: self.max_tokens,
            ca_file,
            max_summary_bytes,
        }
    }
}

/// Settings of one `anthropic` backend. `Debug` never prints the key.
#[derive(Clone)]
pub struct AnthropicConfig {
    /// Endpoint base, e.g. `https://api.anthropic.com`; `None`: the caller's upstream.
    pub base_url: Option<String>,
    /// Model; `None`: the request's own model.
    pub model: Option<String>,
    /// API key sent as `x-api-key`; `None`: the caller's own credentials.
    pub api_key: Option<String>,
    /// The `anthropic-version` header.
    pub anthropic_version: String,
    /// Output budget (capped further by [`SummaryRequest::max_output_tokens`]).
    pub max_tokens: u32,
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
impl Default for AnthropicConfig {
    fn default() -> Self {
        AnthropicConfig {
            base_url: None,
            model: None,
            api_key: None,
            anthropic_version: String::new(),
            max_tokens: 0,
            ca_file: None,
            max_summary_bytes: DEFAULT_MAX_SUMMARY_BYTES,
        }
    }
}

impl fmt::Debug for AnthropicConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AnthropicConfig")
            .field("base_url", &self.base_url)
            .field("model", &self.model)
            .field("api_key", &self.api_key.as_ref().map(|_| "[redacted]"))
            .field("anthropic_version", &self.anthropic_version)
            .field("max_tokens", &self.max_tokens)
            .field("ca_file", &self.ca_file)
            .field("max_summary_bytes", &self.max_summary_bytes)
            .finish()
    }
}

/// The `anthropic` backend. One instance owns one connection pool.
#[derive(Debug)]
pub struct AnthropicSummarizer {
    config: AnthropicConfig,
    http: HttpClient,
}

impl AnthropicSummarizer {
    /// Builds the backend and its HTTP client.
    pub fn new(config: AnthropicConfig) -> Result<AnthropicSummarizer, SummarizeError> {
        let http = HttpClient::new(config.ca_file.as_deref())?
            .with_max_response_bytes(response_limit(config.max_summary_bytes));
        Ok(AnthropicSummarizer { config, http })
    }

    /// The endpoint a request goes to.
    pub fn endpoint(&self, caller: &Caller) -> Result<String, SummarizeError> {
        match &self.config.base_url {
            Some(base) => Ok(join_url(base, "v1/messages")),
            None => transport::endpoint(None, caller, "/v1", "messages"),
        }
    }

    async fn run(&self, request: &SummaryRequest) -> Result<Summary, SummarizeError> {
        let deadline = Instant::now() + request.timeout;
        let url = self.endpoint(&request.caller)?;
        let model = transport::model(self.config.model.as_deref(), request)?;
        let mut auth = self.auth(&request.caller)?;
        let version = HeaderValue::from_str(&self.config.anthropic_version)
            .map_err(|_| SummarizeError::Config("invalid anthropic_version".into()))?;
        auth.headers
            .push((HeaderName::from_static("anthropic-version"), version));
        let exchange = Exchange {
            url: &url,
            auth: &auth,
            model,
            deadline,
            timeout: request.timeout,
        };
        let standalone = || {
            let body = json!({
                "model": model,
                "max_tokens": output_budget(self.config.max_tokens, request.max_output_tokens),
                "system": SYSTEM_PROMPT,
                "messages": [{"role": "user", "content": request.prompt}],
            });
            transport::json_body(&body)
        };
        transport::inside_first(
            "anthropic",
            self.in_conversation(request),
            standalone,
            |body| self.ask(&exchange, body),
        )
        .await
    }

    /// The request asking for the summary inside the conversation, when this backend sends it:
    /// only to the caller's own upstream with the caller's own model over Messages (anywhere
    /// else the provider has nothing cached).
    fn in_conversation(&self, request: &SummaryRequest) -> Option<Bytes> {
        let body = request.in_conversation.as_ref()?;
        self.reads_conversation(request.caller.api)
            .then(|| Bytes::copy_from_slice(body))
    }

    /// Sends one summary request and reads the summary from the answer.
    async fn ask(&self, x: &Exchange<'_>, body: Bytes) -> Result<Summary, SummarizeError> {
        let secrets = x.auth.secret_refs();
        let answer = self
            .http
            .post(
                x.url,
                &x.auth.headers,
                body,
                &secrets,
                x.deadline,
                x.timeout,
            )
            .await?;
        Ok(
            Summary::bounded(text_content(&answer)?.trim(), self.config.max_summary_bytes)?
                .with_usage(usage(&answer, x.model)),
        )
    }

    /// The credential headers: the configured key or the caller's `x-api-key` as `x-api-key`,
    /// else the caller's `authorization`.
    fn auth(&self, caller: &Caller) -> Result<Auth, SummarizeError> {
        let mut auth = Auth::default();
        let key = self
            .config
            .api_key
            .as_deref()
            .or_else(|| caller.credential("x-api-key"));
        if let Some(key) = key {
            auth.add(HeaderName::from_static("x-api-key"), key, &[key])?;
        } else if let Some(value) = caller.credential("authorization") {
            auth.add_bearer(AUTHORIZATION, value)?;
        }
        Ok(auth)
    }
}

impl Summarizer for AnthropicSummarizer {
    fn name(&self) -> &str {
        "anthropic"
    }

    fn summarize<'a>(
        &'a self,
        request: &'a SummaryRequest,
    ) -> BoxFuture<'a, Result<Summary, SummarizeError>> {
        Box::pin(self.run(request))
    }

    /// The configured `max_tokens`, whatever the API (this backend always speaks Messages).
    fn max_output_tokens(&self, api: Api) -> Option<u32> {
        let _ = api;
        (self.config.max_tokens > 0).then_some(self.config.max_tokens)
    }

    /// With no `base_url` and no `model` of its own, for Messages callers.
    fn reads_conversation(&self, api: Api) -> bool {
        self.config.base_url.is_none() && self.config.model.is_none() && api == Api::Messages
    }
}

/// Where one summary is asked for.
struct Exchange<'a> {
    url: &'a str,
    auth: &'a Auth,
    model: &'a str,
    deadline: Instant,
    timeout: std::time::Duration,
}

/// The concatenated `text` blocks of `content`.
fn text_content(answer: &Value) -> Result<String, SummarizeError> {
    let blocks = answer["content"]
        .as_array()
        .ok_or_else(|| SummarizeError::InvalidOutput("response has no `content` array".into()))?;
    let texts: Vec<&str> = blocks
        .iter()
        .filter(|b| b["type"] == "text")
        .filter_map(|b| b["text"].as_str())
        .collect();
    if texts.is_empty() && !blocks.is_empty() {
        return Err(SummarizeError::InvalidOutput(
            "response `content` has no text block".into(),
        ));
    }
    Ok(texts.join(""))
}

/// What an answer's `usage` billed, normalised: Anthropic's `input_tokens` leave out the
/// tokens read from and written to the cache, which `SummaryUsage::input` includes. The model
/// the answer names, else the one asked for; `None` without a usage object.
fn usage(answer: &Value, asked: &str) -> Option<SummaryUsage> {
    let u = answer.get("usage").filter(|u| u.is_object())?;
    let n = |key: &str| u[key].as_u64().unwrap_or(0);
    let (read, written) = (
        n("cache_read_input_tokens"),
        n("cache_creation_input_tokens"),
    );
    Some(SummaryUsage {
        model: answer["model"].as_str().unwrap_or(asked).to_string(),
        input: n("input_tokens") + read + written,
        output: n("output_tokens"),
        cache_read: read,
        cache_write: written,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_default_validate_and_make_the_config() {
        let settings = AnthropicSettings::default();
        assert_eq!(
            (settings.anthropic_version.as_str(), settings.max_tokens),
            ("2023-06-01", 4_096)
        );
        assert_eq!(settings.validate(), Ok(()));
        for (bad, key) in [
            (
                AnthropicSettings {
                    anthropic_version: " ".into(),
                    ..AnthropicSettings::default()
                },
                "anthropic_version",
            ),
            (
                AnthropicSettings {
                    anthropic_version: "a\nb".into(),
                    ..AnthropicSettings::default()
                },
                "anthropic_version",
            ),
            (
                AnthropicSettings {
                    base_url: Some("not a url".into()),
                    ..AnthropicSettings::default()
                },
                "base_url",
            ),
            (
                AnthropicSettings {
                    max_tokens: 0,
                    ..AnthropicSettings::default()
                },
                "max_tokens",
            ),
        ] {
            assert_eq!(bad.validate().map_err(|e| e.key), Err(key), "{bad:?}");
        }
        let own = AnthropicSummarizer::new(settings.config(None, None, 10)).expect("builds");
        assert!(own.reads_conversation(Api::Messages));
        assert!(!own.reads_conversation(Api::ChatCompletions));
        let configured = AnthropicSettings {
            model: Some("claude-haiku-4-5".into()),
            ..AnthropicSettings::default()
        };
        let other = AnthropicSummarizer::new(configured.config(None, None, 10)).expect("builds");
        assert!(!other.reads_conversation(Api::Messages));
        let config = settings.config(Some("k".into()), None, 10);
        assert_eq!(
            (config.api_key.as_deref(), config.max_summary_bytes),
            (Some("k"), 10)
        );
    }

    #[test]
    fn usage_counts_cached_input_in_the_input() {
        let answer = serde_json::json!({"model": "claude-haiku-4-5", "usage": {"input_tokens": 10,
            "output_tokens": 300, "cache_read_input_tokens": 4000, "cache_creation_input_tokens": 500}});
        let u = usage(&answer, "asked").expect("usage");
        assert_eq!(
            (
                u.model.as_str(),
                u.input,
                u.output,
                u.cache_read,
                u.cache_write
            ),
            ("claude-haiku-4-5", 4_510, 300, 4_000, 500)
        );
        assert_eq!(usage(&serde_json::json!({}), "asked"), None);
    }

    #[test]
    fn text_blocks_are_concatenated() {
        let a = json!({"content":[{"type":"thinking","thinking":"x"},{"type":"text","text":"a"},{"type":"text","text":"b"}]});
        assert_eq!(text_content(&a).ok().as_deref(), Some("ab"));
        assert!(matches!(
            text_content(&json!({"content":[{"type":"tool_use"}]})),
            Err(SummarizeError::InvalidOutput(_))
        ));
        assert!(matches!(
            text_content(&json!({"id":"x"})),
            Err(SummarizeError::InvalidOutput(_))
        ));
    }

    #[test]
    fn max_output_tokens_is_the_configured_budget() {
        let s = |max_tokens| {
            AnthropicSummarizer::new(AnthropicConfig {
                max_tokens,
                ..Default::default()
            })
            .expect("build")
        };
        for api in [Api::Messages, Api::ChatCompletions, Api::Responses] {
            assert_eq!(s(2048).max_output_tokens(api), Some(2048));
            assert_eq!(
                s(0).max_output_tokens(api),
                None,
                "0 means no budget of its own"
            );
        }
    }

    #[test]
    fn endpoints_follow_config_or_caller() {
        let s = |base: Option<&str>| {
            AnthropicSummarizer::new(AnthropicConfig {
                base_url: base.map(str::to_owned),
                ..Default::default()
            })
            .expect("build")
        };
        let caller = Caller {
            upstream_base_url: "https://gw.example/anthropic".into(),
            api_prefix: "/v1".into(),
            credentials: vec![],
            ..Caller::default()
        };
        assert_eq!(
            s(Some("https://api.anthropic.com/"))
                .endpoint(&caller)
                .ok()
                .as_deref(),
            Some("https://api.anthropic.com/v1/messages")
        );
        assert_eq!(
            s(None).endpoint(&caller).ok().as_deref(),
            Some("https://gw.example/anthropic/v1/messages")
        );
        assert!(s(None).endpoint(&Caller::default()).is_err());
    }
}
