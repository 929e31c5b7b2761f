//! The `openai` summarizer: any OpenAI-compatible Chat Completions endpoint.
//!
//! With nothing configured it asks the caller's own upstream (`upstream_base_url` +
//! `api_prefix` + `/chat/completions`) with the caller's own model and credentials, so it
//! works with zero configuration. Each setting of [`OpenAiConfig`] overrides one of those.
//! The rendered compaction prompt is sent as the user message behind a short system message;
//! the summary is `choices[0].message.content`.
//!
//! Models that reject `max_tokens` (OpenAI's reasoning models want `max_completion_tokens`)
//! or a non-default `temperature` answer 400 naming the parameter; the request is then re-sent
//! once with the parameter adjusted, inside the same deadline.
//!
//! [`transport`] holds the pooled JSON client shared with the `anthropic` backend.
#![deny(missing_docs)]

pub mod transport;

use std::fmt;
use std::path::PathBuf;

use http::header::{HeaderName, AUTHORIZATION};
use serde_json::{json, Value};
use tokio::time::Instant;

use compactor_plugin_api::{
    BoxFuture, Caller, SummarizeError, Summarizer, Summary, SummaryRequest,
};

use crate::transport::{output_budget, Auth, HttpClient};

/// The system message sent with every summary request.
pub const SYSTEM_PROMPT: &str = "You write compaction summaries of coding-agent conversations. \
Follow the task in the user's message exactly and answer with the summary only.";

/// Settings of one `openai` backend. `Debug` never prints the key.
#[derive(Clone, Default)]
pub struct OpenAiConfig {
    /// Endpoint base, e.g. `https://openrouter.ai/api/v1`; `None`: the caller's upstream and
    /// API prefix.
    pub base_url: Option<String>,
    /// Model; `None`: the request's own model.
    pub model: Option<String>,
    /// API key sent as `Authorization: Bearer`; `None`: the caller's own credentials.
    pub api_key: Option<String>,
    /// Output budget (capped further by [`SummaryRequest::max_output_tokens`]).
    pub max_tokens: u32,
    /// Sampling temperature; `None`: the provider's default.
    pub temperature: Option<f64>,
    /// Extra PEM roots trusted for `https` endpoints.
    pub ca_file: Option<PathBuf>,
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
        let http = HttpClient::new(config.ca_file.as_deref())?;
        Ok(OpenAiSummarizer { config, http })
    }

    /// The endpoint a request goes to.
    pub fn endpoint(&self, caller: &Caller) -> Result<String, SummarizeError> {
        transport::endpoint(
            self.config.base_url.as_deref(),
            caller,
            "",
            "chat/completions",
        )
    }

    async fn run(&self, request: &SummaryRequest) -> Result<Summary, SummarizeError> {
        let deadline = Instant::now() + request.timeout;
        let url = self.endpoint(&request.caller)?;
        let model = transport::model(self.config.model.as_deref(), request)?;
        let auth = self.auth(&request.caller)?;
        let secrets = auth.secret_refs();

        let mut body = json!({
            "model": model,
            "messages": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": request.prompt},
            ],
            "max_tokens": output_budget(self.config.max_tokens, request.max_output_tokens),
            "stream": false,
        });
        if let Some(t) = self.config.temperature {
            body["temperature"] = json!(t);
        }

        let mut adjusted = false;
        let answer = loop {
            match self
                .http
                .post_json(
                    &url,
                    &auth.headers,
                    &body,
                    &secrets,
                    deadline,
                    request.timeout,
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
        Summary::new(message_content(&answer)?.trim())
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn debug_hides_the_key() {
        let c = OpenAiConfig {
            api_key: Some("sk-hidden".into()),
            ..Default::default()
        };
        assert!(!format!("{c:?}").contains("sk-hidden"));
    }
}
