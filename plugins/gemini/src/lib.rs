//! The `gemini` summarizer: the Google Gemini API (`generateContent`).
//!
//! POSTs `{"systemInstruction": {"parts": [{"text": SYSTEM_PROMPT}]}, "contents": [{"role":
//! "user", "parts": [{"text": prompt}]}], "generationConfig": {"maxOutputTokens"}}` to
//! `{base_url}/v1beta/models/{model}:generateContent`, or with no `base_url` to the caller's
//! own upstream: a Gemini caller's `api_prefix` is its path before `:generateContent`, which
//! names its model (`/v1beta/models/gemini-2.5-pro`, or Vertex AI's
//! `/v1/projects/p/locations/l/publishers/google/models/gemini-2.5-pro`), so the summary goes
//! to the same collection (`upstream_base_url` + that prefix's `…/models` +
//! `/{model}:generateContent`); another caller's prefix is followed by
//! `/models/{model}:generateContent` (`/v1beta` when it has none). It
//! reads the concatenated `text` parts of the first candidate, leaving out the thought
//! summaries of thinking models (parts marked `"thought": true`). The model is part of the
//! path, so a model name that would need escaping there (`/`, `?`, `#`, `:`, `%`, whitespace,
//! anything beyond letters, digits and `-._~@+`) is refused rather than sent somewhere else;
//! the API's own resource name `models/{model}` is accepted for `{model}`. Credentials: the
//! configured key as `x-goog-api-key`, else the caller's `x-goog-api-key`, else the caller's
//! `authorization` (Vertex AI and other OAuth-style callers).
//!
//! A request carrying [`SummaryRequest::in_conversation`] is asked that way first when this
//! backend uses the caller's own upstream and model (no `base_url`, no `model`) and the
//! caller spoke the Gemini API: the body is sent as compactor built it (the conversation, so
//! the provider can serve it from its implicit prompt cache), and a refusal of that shape or
//! an answer without text (a `functionCall`, say) is followed by the standalone prompt within
//! the same deadline.
//!
//! [`Summarizer::max_output_tokens`] answers the configured `max_tokens` (the most the request
//! asks for; it is capped further by the request's own budget). An answer cut at that budget
//! (`finishReason: MAX_TOKENS`) is accepted with the text it has, as the `anthropic` backend
//! accepts one cut at `max_tokens`.
//!
//! HTTP, timeouts and error mapping are shared with the `openai` and `anthropic` backends
//! through the `compactor-transport` crate (a Gemini error body, `{"error": {"code",
//! "message", "status"}}`, gives its `message`); the system prompt is the contract's
//! ([`compactor_plugin_api::SYSTEM_PROMPT`]).
#![deny(missing_docs)]

use std::fmt;
use std::path::PathBuf;

use bytes::Bytes;
use http::header::{HeaderName, AUTHORIZATION};
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

/// The API version path of a configured `base_url`.
const API_VERSION: &str = "v1beta";

/// `[summarizer.gemini]` of compactor's configuration file: what a user writes (the key by
/// the name of the environment variable holding it), with its defaults and validation. The
/// app reads the variable and builds the backend with [`GeminiSettings::config`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GeminiSettings {
    /// Endpoint base without the API version, e.g.
    /// `https://generativelanguage.googleapis.com` (requests go to `{base_url}/v1beta/...`);
    /// unset: the request's own upstream.
    pub base_url: Option<String>,
    /// Model, e.g. `gemini-2.5-flash`; unset: the request's own model.
    pub model: Option<String>,
    /// Environment variable holding the API key; unset: the caller's own `x-goog-api-key`
    /// (or `authorization`).
    pub api_key_env: Option<String>,
    /// Output budget of the summary (`maxOutputTokens`).
    pub max_tokens: u32,
}

impl Default for GeminiSettings {
    fn default() -> Self {
        GeminiSettings {
            base_url: None,
            model: None,
            api_key_env: None,
            max_tokens: 4_096,
        }
    }
}

impl GeminiSettings {
    /// Whether the settings can make a backend.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        transport::check_base_url(self.base_url.as_deref())?;
        transport::check_max_tokens(self.max_tokens)?;
        if let Some(model) = &self.model {
            path_model(model).map_err(|reason| InvalidSetting::new("model", reason))?;
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
    ) -> GeminiConfig {
        GeminiConfig {
            base_url: self.base_url.clone(),
            model: self.model.clone(),
            api_key,
            max_tokens: self.max_tokens,
            ca_file,
            max_summary_bytes,
        }
    }
}

/// Settings of one `gemini` backend. `Debug` never prints the key.
#[derive(Clone)]
pub struct GeminiConfig {
    /// Endpoint base without the API version, e.g.
    /// `https://generativelanguage.googleapis.com`; `None`: the caller's upstream and API
    /// prefix.
    pub base_url: Option<String>,
    /// Model; `None`: the request's own model.
    pub model: Option<String>,
    /// API key sent as `x-goog-api-key`; `None`: the caller's own credentials.
    pub api_key: Option<String>,
    /// Output budget, sent as `generationConfig.maxOutputTokens` (capped further by
    /// [`SummaryRequest::max_output_tokens`]).
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
impl Default for GeminiConfig {
    fn default() -> Self {
        GeminiConfig {
            base_url: None,
            model: None,
            api_key: None,
            max_tokens: 0,
            ca_file: None,
            max_summary_bytes: DEFAULT_MAX_SUMMARY_BYTES,
        }
    }
}

impl fmt::Debug for GeminiConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GeminiConfig")
            .field("base_url", &self.base_url)
            .field("model", &self.model)
            .field("api_key", &self.api_key.as_ref().map(|_| "[redacted]"))
            .field("max_tokens", &self.max_tokens)
            .field("ca_file", &self.ca_file)
            .field("max_summary_bytes", &self.max_summary_bytes)
            .finish()
    }
}

/// The `gemini` backend. One instance owns one connection pool.
#[derive(Debug)]
pub struct GeminiSummarizer {
    config: GeminiConfig,
    http: HttpClient,
}

impl GeminiSummarizer {
    /// Builds the backend and its HTTP client.
    pub fn new(config: GeminiConfig) -> Result<GeminiSummarizer, SummarizeError> {
        let http = HttpClient::new(config.ca_file.as_deref())?
            .with_max_response_bytes(response_limit(config.max_summary_bytes));
        Ok(GeminiSummarizer { config, http })
    }

    /// The endpoint a request for `model` goes to:
    /// `{base_url}/v1beta/models/{model}:generateContent`, or `models/{model}:generateContent`
    /// under the caller's upstream and API prefix (`/v1beta` when the caller has none). A model
    /// that cannot stand in the path as it is is a [`SummarizeError::Config`].
    pub fn endpoint(&self, caller: &Caller, model: &str) -> Result<String, SummarizeError> {
        let model = path_model(model).map_err(SummarizeError::Config)?;
        let path = format!("models/{model}:generateContent");
        match &self.config.base_url {
            Some(base) => Ok(join_url(&join_url(base, API_VERSION), &path)),
            None => match model_collection(&caller.api_prefix) {
                Some(collection) => {
                    let caller = Caller {
                        api_prefix: collection.to_string(),
                        ..caller.clone()
                    };
                    let path = format!("{model}:generateContent");
                    transport::endpoint(None, &caller, "", &path)
                }
                None => transport::endpoint(None, caller, &format!("/{API_VERSION}"), &path),
            },
        }
    }

    async fn run(&self, request: &SummaryRequest) -> Result<Summary, SummarizeError> {
        let deadline = Instant::now() + request.timeout;
        let model = transport::model(self.config.model.as_deref(), request)?;
        let model = path_model(model).map_err(SummarizeError::Config)?;
        let url = self.endpoint(&request.caller, model)?;
        let auth = self.auth(&request.caller)?;
        let exchange = Exchange {
            url: &url,
            auth: &auth,
            model,
            deadline,
            timeout: request.timeout,
        };
        let standalone = || {
            let body = json!({
                "systemInstruction": {"parts": [{"text": SYSTEM_PROMPT}]},
                "contents": [{"role": "user", "parts": [{"text": request.prompt}]}],
                "generationConfig": {
                    "maxOutputTokens": output_budget(self.config.max_tokens, request.max_output_tokens),
                },
            });
            transport::json_body(&body)
        };
        transport::inside_first(
            "gemini",
            self.in_conversation(request),
            standalone,
            |body| self.ask(&exchange, body),
        )
        .await
    }

    /// The request asking for the summary inside the conversation, when this backend sends it:
    /// only to the caller's own upstream with the caller's own model over the Gemini API
    /// (anywhere else the provider has nothing cached).
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
        Ok(Summary::bounded(
            candidate_text(&answer)?.trim(),
            self.config.max_summary_bytes,
        )?
        .with_usage(usage(&answer, x.model)))
    }

    /// The credential headers: the configured key or the caller's `x-goog-api-key` as
    /// `x-goog-api-key`, else the caller's `authorization`.
    fn auth(&self, caller: &Caller) -> Result<Auth, SummarizeError> {
        let mut auth = Auth::default();
        let key = self
            .config
            .api_key
            .as_deref()
            .or_else(|| caller.credential("x-goog-api-key"));
        if let Some(key) = key {
            auth.add(HeaderName::from_static("x-goog-api-key"), key, &[key])?;
        } else if let Some(value) = caller.credential("authorization") {
            auth.add_bearer(AUTHORIZATION, value)?;
        }
        Ok(auth)
    }
}

impl Summarizer for GeminiSummarizer {
    fn name(&self) -> &str {
        "gemini"
    }

    fn summarize<'a>(
        &'a self,
        request: &'a SummaryRequest,
    ) -> BoxFuture<'a, Result<Summary, SummarizeError>> {
        Box::pin(self.run(request))
    }

    /// The configured `max_tokens`, whatever the API (this backend always speaks
    /// `generateContent`).
    fn max_output_tokens(&self, api: Api) -> Option<u32> {
        let _ = api;
        (self.config.max_tokens > 0).then_some(self.config.max_tokens)
    }

    /// With no `base_url` and no `model` of its own, for Gemini callers.
    fn reads_conversation(&self, api: Api) -> bool {
        self.config.base_url.is_none() && self.config.model.is_none() && api == Api::Gemini
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

/// The collection a Gemini caller's API prefix names its model in: `/v1beta/models` of
/// `/v1beta/models/gemini-2.5-pro` (`tunedModels` too); `None` for a prefix that names no
/// model (another API's caller).
fn model_collection(api_prefix: &str) -> Option<&str> {
    let (collection, model) = api_prefix.rsplit_once('/')?;
    let name = collection.rsplit('/').next()?;
    (!model.is_empty() && matches!(name, "models" | "tunedModels")).then_some(collection)
}

/// `model` as it stands in the path `models/{model}:generateContent`: without the API's
/// `models/` resource prefix, and only when it needs no escaping there (ASCII letters, digits
/// and `-._~@+`). Anything else (`/`, `?`, `#`, `:`, `%`, whitespace, ...) would change or
/// break the URL, so it is refused with the reason.
fn path_model(model: &str) -> Result<&str, String> {
    let name = model.strip_prefix("models/").unwrap_or(model);
    if name.is_empty() {
        return Err("the model name is empty".into());
    }
    match name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || "-._~@+".contains(*c)))
    {
        None => Ok(name),
        Some(c) => Err(format!(
            "the model name `{}` cannot stand in the request path: it holds {c:?} \
             (letters, digits and -._~@+ only)",
            transport::bounded(model, 100)
        )),
    }
}

/// The concatenated `text` parts of the first candidate, thought summaries (`"thought":
/// true`) left out. A blocked prompt, no candidate or a candidate without text (a
/// `functionCall`, a budget spent on thinking, a safety stop) is
/// [`SummarizeError::InvalidOutput`].
fn candidate_text(answer: &Value) -> Result<String, SummarizeError> {
    if let Some(reason) = answer
        .get("promptFeedback")
        .and_then(|f| f.get("blockReason"))
        .filter(|r| !r.is_null())
    {
        return Err(SummarizeError::InvalidOutput(format!(
            "the prompt was blocked ({})",
            reason.as_str().unwrap_or("no reason given")
        )));
    }
    let candidate = answer["candidates"]
        .as_array()
        .and_then(|c| c.first())
        .ok_or_else(|| SummarizeError::InvalidOutput("response has no candidates".into()))?;
    let texts: Vec<&str> = candidate["content"]["parts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["thought"].as_bool() != Some(true))
        .filter_map(|p| p["text"].as_str())
        .collect();
    if texts.is_empty() {
        return Err(SummarizeError::InvalidOutput(
            match candidate["finishReason"].as_str() {
                Some(reason) => format!("the first candidate has no text (finishReason {reason})"),
                None => "the first candidate has no text".into(),
            },
        ));
    }
    Ok(texts.concat())
}

/// What an answer's `usageMetadata` billed: `promptTokenCount` counts every input token
/// (`cachedContentTokenCount` of them read from the cache), and the output is the candidates'
/// tokens plus the thinking (`thoughtsTokenCount`), billed as output. The model the answer
/// names (`modelVersion`), else the one asked for; `None` without usage metadata.
fn usage(answer: &Value, asked: &str) -> Option<SummaryUsage> {
    let u = answer.get("usageMetadata").filter(|u| u.is_object())?;
    let n = |key: &str| u[key].as_u64().unwrap_or(0);
    Some(SummaryUsage {
        model: answer["modelVersion"]
            .as_str()
            .filter(|m| !m.is_empty())
            .unwrap_or(asked)
            .to_string(),
        input: n("promptTokenCount"),
        output: n("candidatesTokenCount").saturating_add(n("thoughtsTokenCount")),
        cache_read: n("cachedContentTokenCount"),
        cache_write: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_default_validate_and_make_the_config() {
        let settings = GeminiSettings::default();
        assert_eq!(settings.max_tokens, 4_096);
        assert_eq!(
            (&settings.base_url, &settings.model, &settings.api_key_env),
            (&None, &None, &None)
        );
        assert_eq!(settings.validate(), Ok(()));
        for (bad, key) in [
            (
                GeminiSettings {
                    base_url: Some("not a url".into()),
                    ..GeminiSettings::default()
                },
                "base_url",
            ),
            (
                GeminiSettings {
                    base_url: Some("https://generativelanguage.googleapis.com?key=x".into()),
                    ..GeminiSettings::default()
                },
                "base_url",
            ),
            (
                GeminiSettings {
                    max_tokens: 0,
                    ..GeminiSettings::default()
                },
                "max_tokens",
            ),
            (
                GeminiSettings {
                    model: Some("tunedModels/mine".into()),
                    ..GeminiSettings::default()
                },
                "model",
            ),
            (
                GeminiSettings {
                    model: Some(String::new()),
                    ..GeminiSettings::default()
                },
                "model",
            ),
        ] {
            assert_eq!(bad.validate().map_err(|e| e.key), Err(key), "{bad:?}");
        }
        let good = GeminiSettings {
            base_url: Some("https://generativelanguage.googleapis.com".into()),
            model: Some("models/gemini-2.5-flash".into()),
            api_key_env: Some("GEMINI_API_KEY".into()),
            max_tokens: 1,
        };
        assert_eq!(good.validate(), Ok(()));

        let own = GeminiSummarizer::new(settings.config(None, None, 10)).expect("builds");
        assert!(own.reads_conversation(Api::Gemini));
        for api in [Api::ChatCompletions, Api::Messages, Api::Responses] {
            assert!(!own.reads_conversation(api), "{api:?}");
        }
        let other = GeminiSummarizer::new(good.config(None, None, 10)).expect("builds");
        assert!(!other.reads_conversation(Api::Gemini));
        let config = good.config(Some("k".into()), Some("/ca.pem".into()), 10);
        assert_eq!(
            (
                config.base_url.as_deref(),
                config.model.as_deref(),
                config.api_key.as_deref(),
                config.max_tokens,
                config.max_summary_bytes
            ),
            (
                Some("https://generativelanguage.googleapis.com"),
                Some("models/gemini-2.5-flash"),
                Some("k"),
                1,
                10
            )
        );
        assert_eq!(config.ca_file, Some(PathBuf::from("/ca.pem")));
    }

    #[test]
    fn settings_deserialize_with_defaults_and_reject_unknown_keys() {
        let s: GeminiSettings =
            serde_json::from_value(json!({"model": "gemini-2.5-flash"})).expect("parses");
        assert_eq!(
            s,
            GeminiSettings {
                model: Some("gemini-2.5-flash".into()),
                ..GeminiSettings::default()
            }
        );
        for unknown in [json!({"api_key": "AIza-secret"}), json!({"maxTokens": 10})] {
            let e = serde_json::from_value::<GeminiSettings>(unknown).expect_err("unknown key");
            assert!(e.to_string().contains("unknown field"), "{e}");
        }
    }

    #[test]
    fn the_key_never_shows_in_debug_output() {
        let config = GeminiConfig {
            api_key: Some("AIza-very-secret".into()),
            ..GeminiConfig::default()
        };
        let shown = format!("{config:?}");
        assert!(!shown.contains("AIza-very-secret"), "{shown}");
        assert!(shown.contains("[redacted]"), "{shown}");
        let plugin = GeminiSummarizer::new(config).expect("builds");
        let shown = format!("{plugin:?}");
        assert!(!shown.contains("AIza-very-secret"), "{shown}");
    }

    #[test]
    fn model_names_must_stand_in_the_path_as_they_are() {
        for good in [
            "gemini-2.5-flash",
            "gemini-2.5-flash-preview-05-20",
            "gemini-1.5-pro-001",
            "gemma-3-27b-it",
            "my_model.v2~x@1+2",
        ] {
            assert_eq!(path_model(good), Ok(good));
        }
        assert_eq!(path_model("models/gemini-2.5-pro"), Ok("gemini-2.5-pro"));
        for bad in [
            "",
            "models/",
            "tunedModels/mine",
            "models/a/b",
            "gemini/gemini-2.5-flash",
            "a?alt=sse",
            "a#b",
            "a:streamGenerateContent",
            "gemini 2.5",
            "gemini\t",
            "a%2Fb",
            "gémini",
            "a\"b",
        ] {
            assert!(path_model(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn usage_maps_cache_and_thinking() {
        let answer = json!({"modelVersion": "gemini-2.5-flash-001", "usageMetadata": {
            "promptTokenCount": 5000, "candidatesTokenCount": 300, "thoughtsTokenCount": 700,
            "cachedContentTokenCount": 4096, "totalTokenCount": 6000}});
        let u = usage(&answer, "asked").expect("usage");
        assert_eq!(
            (
                u.model.as_str(),
                u.input,
                u.output,
                u.cache_read,
                u.cache_write
            ),
            ("gemini-2.5-flash-001", 5_000, 1_000, 4_096, 0)
        );
        let plain = json!({"usageMetadata": {"promptTokenCount": 10, "candidatesTokenCount": 3}});
        let u = usage(&plain, "asked").expect("usage");
        assert_eq!(
            (u.model.as_str(), u.input, u.output, u.cache_read),
            ("asked", 10, 3, 0)
        );
        let huge =
            json!({"usageMetadata": {"candidatesTokenCount": u64::MAX, "thoughtsTokenCount": 1}});
        assert_eq!(usage(&huge, "m").map(|u| u.output), Some(u64::MAX));
        assert_eq!(usage(&json!({}), "asked"), None);
        assert_eq!(usage(&json!({"usageMetadata": null}), "asked"), None);
    }

    #[test]
    fn text_parts_are_concatenated_without_thoughts() {
        let a = json!({"candidates": [{"content": {"role": "model", "parts": [
            {"text": "thinking about it", "thought": true},
            {"text": "a"},
            {"functionCall": {"name": "f", "args": {}}},
            {"text": "b", "thought": false}
        ]}, "finishReason": "STOP"}, {"content": {"parts": [{"text": "second candidate"}]}}]});
        assert_eq!(candidate_text(&a).ok().as_deref(), Some("ab"));
        let cut = json!({"candidates": [{"content": {"parts": [{"text": "partial"}]},
            "finishReason": "MAX_TOKENS"}]});
        assert_eq!(candidate_text(&cut).ok().as_deref(), Some("partial"));
        for (answer, says) in [
            (json!({}), "no candidates"),
            (json!({"candidates": []}), "no candidates"),
            (
                json!({"promptFeedback": {"blockReason": "SAFETY"}}),
                "blocked (SAFETY)",
            ),
            (
                json!({"candidates": [{"content": {"parts": [{"text": "x"}]}}],
                    "promptFeedback": {"blockReason": "OTHER"}}),
                "blocked (OTHER)",
            ),
            (
                json!({"candidates": [{"content": {"parts": [
                    {"functionCall": {"name": "Bash", "args": {}}}]}, "finishReason": "STOP"}]}),
                "no text (finishReason STOP)",
            ),
            (
                json!({"candidates": [{"content": {"role": "model"}, "finishReason": "MAX_TOKENS"}]}),
                "no text (finishReason MAX_TOKENS)",
            ),
            (
                json!({"candidates": [{"content": {"parts": [{"text": "hm", "thought": true}]}}]}),
                "no text",
            ),
        ] {
            match candidate_text(&answer) {
                Err(SummarizeError::InvalidOutput(m)) => assert!(m.contains(says), "{m}"),
                other => panic!("{answer}: {other:?}"),
            }
        }
        // Blank text is text: `Summary::bounded` calls it blank.
        let blank = json!({"candidates": [{"content": {"parts": [{"text": " \n"}]}}]});
        assert_eq!(candidate_text(&blank).ok().as_deref(), Some(" \n"));
        // A prompt feedback without a block reason is not a block.
        let fine = json!({"candidates": [{"content": {"parts": [{"text": "ok"}]}}],
            "promptFeedback": {"safetyRatings": []}});
        assert_eq!(candidate_text(&fine).ok().as_deref(), Some("ok"));
    }

    #[test]
    fn max_output_tokens_is_the_configured_budget() {
        let s = |max_tokens| {
            GeminiSummarizer::new(GeminiConfig {
                max_tokens,
                ..Default::default()
            })
            .expect("build")
        };
        for api in [
            Api::Gemini,
            Api::Messages,
            Api::ChatCompletions,
            Api::Responses,
        ] {
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
            GeminiSummarizer::new(GeminiConfig {
                base_url: base.map(str::to_owned),
                ..Default::default()
            })
            .expect("build")
        };
        let caller = Caller {
            upstream_base_url: "https://gw.example/google".into(),
            api_prefix: "/v1beta".into(),
            api: Api::Gemini,
            ..Caller::default()
        };
        assert_eq!(
            s(Some("https://generativelanguage.googleapis.com/"))
                .endpoint(&caller, "gemini-2.5-flash")
                .ok()
                .as_deref(),
            Some("https://generativelanguage.googleapis.com/v1beta/models/gemini-2.5-flash:generateContent")
        );
        assert_eq!(
            s(None)
                .endpoint(&caller, "models/gemini-2.5-pro")
                .ok()
                .as_deref(),
            Some("https://gw.example/google/v1beta/models/gemini-2.5-pro:generateContent")
        );
        // A Gemini caller's prefix names its model: the summary goes to that collection.
        let own = |prefix: &str| Caller {
            api_prefix: prefix.into(),
            ..caller.clone()
        };
        assert_eq!(
            s(None)
                .endpoint(&own("/v1beta/models/gemini-2.5-flash"), "gemini-2.5-pro")
                .ok()
                .as_deref(),
            Some("https://gw.example/google/v1beta/models/gemini-2.5-pro:generateContent")
        );
        assert_eq!(
            s(None)
                .endpoint(
                    &own("/v1/projects/p/locations/us-central1/publishers/google/models/gemini-2.5-pro"),
                    "gemini-2.5-pro"
                )
                .ok()
                .as_deref(),
            Some("https://gw.example/google/v1/projects/p/locations/us-central1/publishers/google/models/gemini-2.5-pro:generateContent")
        );
        let no_prefix = Caller {
            api_prefix: String::new(),
            ..caller.clone()
        };
        assert_eq!(
            s(None).endpoint(&no_prefix, "g").ok().as_deref(),
            Some("https://gw.example/google/v1beta/models/g:generateContent")
        );
        assert!(matches!(
            s(None).endpoint(&Caller::default(), "g"),
            Err(SummarizeError::Config(_))
        ));
        assert!(matches!(
            s(None).endpoint(&caller, "a/b"),
            Err(SummarizeError::Config(_))
        ));
    }
}
