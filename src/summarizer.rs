//! Summarizer backends: the one place that maps backend names to plugins.
//!
//! [`build`] turns `[summarizer]` into one `Arc<dyn Summarizer>`: the primary backend followed
//! by its fallbacks, each built and validated at start-up (an unknown name, a missing
//! `exec.command` or an `api_key_env` naming an unset variable fails with a [`BuildError`]
//! naming the key), wrapped in a [`Chain`]. The chain tries the backends in order, bounds each
//! attempt by `summarizer.timeout_secs`, answers with the first summary, and records
//! `compactor_summarizer_requests_total{backend,outcome}` (`ok`, `fallback_ok` or the error's
//! kind) and `compactor_summarizer_duration_seconds{backend}` per attempt. Failures are logged
//! at `warn` with the backend and kind, never with the prompt or credentials.
//!
//! `auto` is not a plugin of its own: it builds `openai`, `anthropic` and `gemini` and sends
//! each summary request to the one speaking the wire API of the request being compacted
//! ([`Caller::api`]): Anthropic Messages requests to `anthropic`, Gemini requests to `gemini`,
//! everything else (Chat Completions, Responses) to `openai`.
//!
//! `summarizer.max_summary_bytes` bounds every backend twice: what it reads (the `openai` and
//! `anthropic` backends read a provider's whole answer body, `exec` a program's stdout, up to
//! the bound plus [`SUMMARY_ENVELOPE_BYTES`](compactor_plugin_api::SUMMARY_ENVELOPE_BYTES) and refuse the rest unread) and the summary text
//! it answers with, which the [`Chain`] checks for every backend, local ones (`extractive`,
//! whose output grows with the number of user turns) and third-party plugins included. Either
//! excess is [`SummarizeError::TooLarge`], counted as `too_large`. With no further configuration both use the caller's own
//! upstream, model and credentials, so `auto` works unconfigured behind any upstream. A
//! Responses request is summarised through the Responses API (`openai` picks the wire API from
//! [`Caller::api`] itself).
//!
//! [`Summarizer::max_output_tokens`] follows the same routing: `auto` answers with the budget
//! of the backend it would pick for that API, and a [`Chain`] with its primary backend's (the
//! first backend that has one), so the engine leaves room for the summary that will be asked
//! for.
//!
//! Adding a backend: write a crate implementing [`Summarizer`] and add one arm to
//! [`backend`]'s match (see `plugins/README.md`).
//!
//! [`Caller::api`]: compactor_plugin_api::Caller::api

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use compactor_plugin_anthropic::AnthropicSummarizer;
use compactor_plugin_api::{
    Api, BoxFuture, InvalidSetting, SummarizeError, Summarizer, Summary, SummaryRequest,
};
use compactor_plugin_exec::ExecSummarizer;
use compactor_plugin_extractive::ExtractiveSummarizer;
use compactor_plugin_gemini::GeminiSummarizer;
use compactor_plugin_openai::OpenAiSummarizer;

use crate::compaction::models::ModelTable;
use crate::config::Config;
use crate::dialect::DialectKind;
use crate::metrics::Metrics;

/// Every backend name [`build`] knows.
pub const BACKENDS: [&str; 6] = [
    "openai",
    "anthropic",
    "gemini",
    "extractive",
    "exec",
    "auto",
];

/// A backend name or its required keys are wrong.
#[derive(Debug, thiserror::Error)]
#[error("invalid `{key}`: {reason}")]
pub struct BuildError {
    /// The dotted key at fault, e.g. `summarizer.fallback[0]`.
    pub key: String,
    /// What is wrong with it.
    pub reason: String,
}

fn err(key: impl Into<String>, reason: impl Into<String>) -> BuildError {
    BuildError {
        key: key.into(),
        reason: reason.into(),
    }
}

/// Builds the configured backend with its fallback chain, timeouts and metrics.
pub fn build(config: &Config, metrics: Arc<Metrics>) -> Result<Arc<dyn Summarizer>, BuildError> {
    let s = &config.summarizer;
    let mut backends = vec![backend(config, &s.backend, "summarizer.backend")?];
    for (i, name) in s.fallback.iter().enumerate() {
        backends.push(backend(config, name, &format!("summarizer.fallback[{i}]"))?);
    }
    Ok(Arc::new(
        Chain::new(
            backends,
            config.summarizer_timeout(),
            s.max_summary_bytes,
            metrics,
        )
        .priced_by(ModelTable::of(config)),
    ))
}

/// Builds one backend by name; `key` is the config key that named it.
pub fn backend(config: &Config, name: &str, key: &str) -> Result<Arc<dyn Summarizer>, BuildError> {
    let s = &config.summarizer;
    let ca_file = config.upstream.ca_file.clone();
    let built: Arc<dyn Summarizer> = match name {
        "openai" => {
            let c = &s.openai;
            c.validate().map_err(|e| setting("openai", e))?;
            let api_key = api_key("summarizer.openai.api_key_env", c.api_key_env.as_deref())?;
            let plugin = OpenAiSummarizer::new(c.config(api_key, ca_file, s.max_summary_bytes))
                .map_err(|e| err("upstream.ca_file", e.to_string()))?;
            Arc::new(plugin)
        }
        "anthropic" => {
            let c = &s.anthropic;
            c.validate().map_err(|e| setting("anthropic", e))?;
            let api_key = api_key("summarizer.anthropic.api_key_env", c.api_key_env.as_deref())?;
            let plugin = AnthropicSummarizer::new(c.config(api_key, ca_file, s.max_summary_bytes))
                .map_err(|e| err("upstream.ca_file", e.to_string()))?;
            Arc::new(plugin)
        }
        "gemini" => {
            let c = &s.gemini;
            c.validate().map_err(|e| setting("gemini", e))?;
            let api_key = api_key("summarizer.gemini.api_key_env", c.api_key_env.as_deref())?;
            let plugin = GeminiSummarizer::new(c.config(api_key, ca_file, s.max_summary_bytes))
                .map_err(|e| err("upstream.ca_file", e.to_string()))?;
            Arc::new(plugin)
        }
        "extractive" => {
            s.extractive
                .validate()
                .map_err(|e| setting("extractive", e))?;
            Arc::new(ExtractiveSummarizer::new(s.extractive.clone()))
        }
        "exec" => {
            let c = &s.exec;
            c.validate().map_err(|e| setting("exec", e))?;
            let exec = c
                .config(s.max_summary_bytes)
                .map_err(|e| setting("exec", e))?;
            Arc::new(ExecSummarizer::new(exec))
        }
        "auto" => Arc::new(Auto {
            openai: backend(config, "openai", key)?,
            anthropic: backend(config, "anthropic", key)?,
            gemini: backend(config, "gemini", key)?,
        }),
        other => {
            return Err(err(
                key,
                format!(
                    "unknown summarizer backend `{other}`; expected one of {}",
                    BACKENDS.join(", ")
                ),
            ))
        }
    };
    Ok(built)
}

/// A plugin's invalid setting, named by its full key (`summarizer.<backend>.<key>`).
fn setting(backend: &str, e: InvalidSetting) -> BuildError {
    err(format!("summarizer.{backend}.{}", e.key), e.reason)
}

/// The value of the variable named by an `api_key_env` setting.
fn api_key(key: &str, var: Option<&str>) -> Result<Option<String>, BuildError> {
    let Some(var) = var else {
        return Ok(None);
    };
    match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => Ok(Some(v.trim().to_owned())),
        Ok(_) => Err(err(key, format!("environment variable `{var}` is empty"))),
        Err(std::env::VarError::NotPresent) => {
            Err(err(key, format!("environment variable `{var}` is not set")))
        }
        Err(std::env::VarError::NotUnicode(_)) => Err(err(
            key,
            format!("environment variable `{var}` is not valid UTF-8"),
        )),
    }
}

/// The `auto` backend: `anthropic` for Anthropic Messages requests, `gemini` for Gemini
/// requests, `openai` for the rest.
struct Auto {
    openai: Arc<dyn Summarizer>,
    anthropic: Arc<dyn Summarizer>,
    gemini: Arc<dyn Summarizer>,
}

impl Auto {
    /// The backend that answers for a request that used `api`.
    fn pick(&self, api: Api) -> &Arc<dyn Summarizer> {
        match api {
            Api::Messages => &self.anthropic,
            Api::Gemini => &self.gemini,
            Api::ChatCompletions | Api::Responses => &self.openai,
        }
    }
}

impl Summarizer for Auto {
    fn name(&self) -> &str {
        "auto"
    }

    fn summarize<'a>(
        &'a self,
        request: &'a SummaryRequest,
    ) -> BoxFuture<'a, Result<Summary, SummarizeError>> {
        self.pick(request.caller.api).summarize(request)
    }

    fn max_output_tokens(&self, api: Api) -> Option<u32> {
        self.pick(api).max_output_tokens(api)
    }

    fn reads_conversation(&self, api: Api) -> bool {
        self.pick(api).reads_conversation(api)
    }
}

/// Backends tried in order, each attempt bounded by a timeout and counted in the metrics.
pub struct Chain {
    backends: Vec<Arc<dyn Summarizer>>,
    timeout: Duration,
    /// Longest summary text taken from any backend, in bytes.
    max_summary_bytes: usize,
    metrics: Arc<Metrics>,
    /// Prices summaries whose backend reported what the model billed ([`Chain::priced_by`]).
    models: Option<ModelTable>,
}

impl Chain {
    /// A chain trying `backends` in order, giving each attempt at most `timeout` and taking
    /// summaries of at most `max_summary_bytes`.
    pub fn new(
        backends: Vec<Arc<dyn Summarizer>>,
        timeout: Duration,
        max_summary_bytes: usize,
        metrics: Arc<Metrics>,
    ) -> Chain {
        for backend in &backends {
            metrics.summarizer_backend(backend.name());
        }
        Chain {
            backends,
            timeout,
            max_summary_bytes,
            metrics,
            models: None,
        }
    }

    /// This chain pricing each summary a backend reports the usage of with `models`
    /// (`compactor_cost_usd_total{kind="summarizer"}`, by the dialect of the request being
    /// compacted).
    pub fn priced_by(self, models: ModelTable) -> Chain {
        Chain {
            models: Some(models),
            ..self
        }
    }

    /// Counts what a summary cost, when its backend said and its model has a price.
    fn bill(&self, request: &SummaryRequest, summary: &Summary) {
        let (Some(models), Some(usage)) = (&self.models, &summary.usage) else {
            return;
        };
        let Some(price) = models.price(&usage.model) else {
            return;
        };
        self.metrics.summarizer_cost(
            DialectKind::of_api(request.caller.api),
            crate::cost::Bill::of(&usage.into(), &price).total(),
        );
    }

    async fn run(&self, request: &SummaryRequest) -> Result<Summary, SummarizeError> {
        // The request's own timeout (set by the engine) can only shorten an attempt.
        let attempt_timeout = if request.timeout.is_zero() {
            self.timeout
        } else {
            self.timeout.min(request.timeout)
        };
        let request: Cow<'_, SummaryRequest> = if request.timeout == attempt_timeout {
            Cow::Borrowed(request)
        } else {
            let mut r = request.clone();
            r.timeout = attempt_timeout;
            Cow::Owned(r)
        };
        let mut last = SummarizeError::Config("no summarizer backend configured".into());
        for (i, backend) in self.backends.iter().enumerate() {
            let name = backend.name();
            let started = Instant::now();
            let result = tokio::time::timeout(attempt_timeout, backend.summarize(&request))
                .await
                .unwrap_or(Err(SummarizeError::Timeout(attempt_timeout)))
                .and_then(|s| {
                    Summary::bounded(s.text, self.max_summary_bytes).map(|b| b.with_usage(s.usage))
                });
            match result {
                Ok(summary) => {
                    self.bill(&request, &summary);
                    self.metrics
                        .summarizer_answered(name, i > 0, started.elapsed());
                    if i > 0 {
                        tracing::info!(
                            backend = name,
                            attempt = i + 1,
                            "fallback summarizer answered"
                        );
                    }
                    return Ok(summary);
                }
                Err(e) => {
                    self.metrics.summarizer_failed(name, &e, started.elapsed());
                    tracing::warn!(
                        backend = name,
                        kind = e.kind(),
                        attempt = i + 1,
                        error = %e,
                        "summarizer failed"
                    );
                    last = e;
                }
            }
        }
        Err(last)
    }
}

impl Summarizer for Chain {
    fn name(&self) -> &str {
        self.backends.first().map(|b| b.name()).unwrap_or("none")
    }

    fn summarize<'a>(
        &'a self,
        request: &'a SummaryRequest,
    ) -> BoxFuture<'a, Result<Summary, SummarizeError>> {
        Box::pin(self.run(request))
    }

    /// The primary backend's budget: the first backend in the chain that has one (a local
    /// primary such as `extractive` has none, so its LLM fallback's counts).
    fn max_output_tokens(&self, api: Api) -> Option<u32> {
        self.backends.iter().find_map(|b| b.max_output_tokens(api))
    }

    /// Any backend of the chain that would send it (a fallback may).
    fn reads_conversation(&self, api: Api) -> bool {
        self.backends.iter().any(|b| b.reads_conversation(api))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics() -> Arc<Metrics> {
        Arc::new(Metrics::new().expect("metrics"))
    }

    fn build_err(toml: &str) -> BuildError {
        let config = Config::from_toml(toml).expect("config parses");
        match build(&config, metrics()) {
            Ok(_) => panic!("expected a build error for {toml}"),
            Err(e) => e,
        }
    }

    #[test]
    fn defaults_build_with_zero_configuration() {
        let config = Config::from_toml("").expect("config");
        let s = build(&config, metrics()).expect("default builds");
        assert_eq!(
            s.name(),
            "auto",
            "the request's own provider, in its own API"
        );
    }

    #[test]
    fn every_known_backend_builds() {
        let config = Config::from_toml(
            "[summarizer]\nbackend = \"anthropic\"\nfallback = [\"openai\", \"extractive\", \"exec\"]\n\
             [summarizer.exec]\ncommand = \"/bin/sh\"\n",
        )
        .expect("config");
        let s = build(&config, metrics()).expect("builds");
        assert_eq!(s.name(), "anthropic");
    }

    #[test]
    fn auto_builds_both_backends_and_validates_them() {
        let config = Config::from_toml("[summarizer]\nbackend = \"auto\"\n").expect("config");
        let s = build(&config, metrics()).expect("auto builds with zero configuration");
        assert_eq!(s.name(), "auto");
        let e =
            build_err("[summarizer]\nbackend = \"auto\"\n[summarizer.anthropic]\nmax_tokens = 0\n");
        assert_eq!(e.key, "summarizer.anthropic.max_tokens");
    }

    /// openai asks for 1111 tokens, anthropic for 2222, gemini for 3333.
    const DISTINCT_BUDGETS: &str = "[summarizer.openai]\nmax_tokens = 1111\n\
        [summarizer.anthropic]\nmax_tokens = 2222\nanthropic_version = \"2023-06-01\"\n\
        [summarizer.gemini]\nmax_tokens = 3333\n";

    #[test]
    fn auto_reports_the_budget_of_the_backend_it_picks() {
        let config = Config::from_toml(DISTINCT_BUDGETS).expect("config");
        let auto = Auto {
            openai: backend(&config, "openai", "summarizer.backend").expect("openai"),
            anthropic: backend(&config, "anthropic", "summarizer.backend").expect("anthropic"),
            gemini: backend(&config, "gemini", "summarizer.backend").expect("gemini"),
        };
        assert_eq!(auto.max_output_tokens(Api::Messages), Some(2222));
        assert_eq!(auto.max_output_tokens(Api::Gemini), Some(3333));
        assert_eq!(auto.max_output_tokens(Api::ChatCompletions), Some(1111));
        assert_eq!(auto.max_output_tokens(Api::Responses), Some(1111));

        // The default chain is `auto` alone, and answers the same through it.
        let chain = build(&config, metrics()).expect("builds");
        assert_eq!(chain.name(), "auto");
        assert_eq!(chain.max_output_tokens(Api::Messages), Some(2222));
        assert_eq!(chain.max_output_tokens(Api::Responses), Some(1111));
        assert_eq!(chain.max_output_tokens(Api::Gemini), Some(3333));
    }

    #[test]
    fn a_chain_reports_its_first_backend_with_a_budget() {
        let config = Config::from_toml(&format!(
            "[summarizer]\nbackend = \"anthropic\"\nfallback = [\"openai\"]\n{DISTINCT_BUDGETS}"
        ))
        .expect("config");
        let chain = build(&config, metrics()).expect("builds");
        for api in [Api::Messages, Api::ChatCompletions, Api::Responses] {
            assert_eq!(
                chain.max_output_tokens(api),
                Some(2222),
                "{api:?}: the primary's"
            );
        }

        let config = Config::from_toml(&format!(
            "[summarizer]\nbackend = \"extractive\"\nfallback = [\"auto\"]\n{DISTINCT_BUDGETS}"
        ))
        .expect("config");
        let chain = build(&config, metrics()).expect("builds");
        assert_eq!(chain.max_output_tokens(Api::Messages), Some(2222));
        assert_eq!(chain.max_output_tokens(Api::ChatCompletions), Some(1111));

        let config = Config::from_toml("[summarizer]\nbackend = \"extractive\"\n").expect("config");
        let chain = build(&config, metrics()).expect("builds");
        assert_eq!(chain.max_output_tokens(Api::ChatCompletions), None);
    }

    /// Answers `len` bytes of summary.
    struct Fixed {
        name: &'static str,
        len: usize,
    }

    impl Summarizer for Fixed {
        fn name(&self) -> &str {
            self.name
        }

        fn summarize<'a>(
            &'a self,
            _request: &'a SummaryRequest,
        ) -> BoxFuture<'a, Result<Summary, SummarizeError>> {
            let text = "s".repeat(self.len);
            Box::pin(async move { Ok(Summary { text, usage: None }) })
        }
    }

    fn summary_request() -> SummaryRequest {
        SummaryRequest {
            in_conversation: None,
            prompt: "p".into(),
            prior_summary: None,
            entries: vec![],
            read_files: vec![],
            modified_files: vec![],
            instructions: None,
            compaction_num: 1,
            model: None,
            max_output_tokens: 100,
            timeout: Duration::from_secs(5),
            caller: Default::default(),
        }
    }

    #[tokio::test]
    async fn the_chain_refuses_summaries_over_the_bound_from_any_backend() {
        let m = metrics();
        let big: Arc<dyn Summarizer> = Arc::new(Fixed {
            name: "big",
            len: 101,
        });
        let fits: Arc<dyn Summarizer> = Arc::new(Fixed {
            name: "fits",
            len: 100,
        });
        let chain = Chain::new(vec![big.clone()], Duration::from_secs(5), 100, m.clone());
        match chain.summarize(&summary_request()).await {
            Err(SummarizeError::TooLarge { limit: 100, .. }) => {}
            other => panic!("expected too large, got {other:?}"),
        }
        // A fallback is another backend: it is still asked.
        let chain = Chain::new(vec![big, fits], Duration::from_secs(5), 100, m.clone());
        let summary = chain.summarize(&summary_request()).await.expect("fallback");
        assert_eq!(summary.text.len(), 100);
        let text = m.render();
        for (series, count) in [
            (r#"{backend="big",outcome="too_large"}"#, 2),
            (r#"{backend="fits",outcome="fallback_ok"}"#, 1),
        ] {
            let line = format!("compactor_summarizer_requests_total{series} {count}\n");
            assert!(text.contains(&line), "{line} missing:\n{text}");
        }
    }

    /// Answers a summary with what `model` billed for it.
    struct Billed {
        model: &'static str,
    }

    impl Summarizer for Billed {
        fn name(&self) -> &str {
            "billed"
        }

        fn summarize<'a>(
            &'a self,
            _request: &'a SummaryRequest,
        ) -> BoxFuture<'a, Result<Summary, SummarizeError>> {
            let usage = compactor_plugin_api::SummaryUsage {
                model: self.model.into(),
                input: 100_000,
                output: 2_000,
                cache_read: 50_000,
                cache_write: 0,
            };
            Box::pin(async move { Ok(Summary::new("a summary")?.with_usage(Some(usage))) })
        }
    }

    #[tokio::test]
    async fn summaries_a_backend_reports_the_usage_of_are_priced_at_their_model() {
        let config = Config::from_toml(
            "[models.\"summary-model\"]\ncontext_window = 100000\n\
             price = { input = 2.0, output = 8.0, cache_read = 0.5 }\n",
        )
        .expect("config");
        let m = metrics();
        let models = || ModelTable::new(&config.models, 1000);
        let cost = |m: &Metrics| {
            m.render()
                .lines()
                .find(|l| {
                    l.starts_with(
                        r#"compactor_cost_usd_total{dialect="messages",kind="summarizer"}"#,
                    )
                })
                .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .expect("the series is exported")
        };
        let mut request = summary_request();
        request.caller.api = Api::Messages;
        for model in ["summary-model", "unpriced-model"] {
            let billed: Arc<dyn Summarizer> = Arc::new(Billed { model });
            let chain = Chain::new(vec![billed], Duration::from_secs(5), 1000, m.clone())
                .priced_by(models());
            let summary = chain.summarize(&request).await.expect("a summary");
            assert_eq!(summary.usage.map(|u| u.output), Some(2_000), "kept");
        }
        // 50k uncached at $2, 50k cached at $0.5, 2k output at $8; the unpriced one adds nothing.
        let want = 50_000.0 * 2e-6 + 50_000.0 * 0.5e-6 + 2_000.0 * 8e-6;
        assert!((cost(&m) - want).abs() < 1e-9, "{} != {want}", cost(&m));
    }

    #[tokio::test]
    async fn the_summary_bound_reaches_the_exec_backend() {
        // `yes` writes without end: the program is stopped at the bound plus the envelope.
        let config = Config::from_toml(
            "[summarizer]\nbackend = \"exec\"\nmax_summary_bytes = 5000\n\
             [summarizer.exec]\ncommand = \"/bin/sh\"\nargs = [\"-c\", \"yes\"]\n",
        )
        .expect("config");
        let exec = backend(&config, "exec", "summarizer.backend").expect("builds");
        match exec.summarize(&summary_request()).await {
            Err(SummarizeError::TooLarge { what, limit }) => {
                assert_eq!(what, "stdout");
                assert_eq!(limit, 5000 + compactor_plugin_api::SUMMARY_ENVELOPE_BYTES);
            }
            other => panic!("expected too large, got {other:?}"),
        }
    }

    #[test]
    fn unknown_names_name_their_key() {
        let e = build_err("[summarizer]\nbackend = \"gpt\"\n");
        assert_eq!(e.key, "summarizer.backend");
        assert!(e.to_string().contains("summarizer.backend"), "{e}");
        let e = build_err("[summarizer]\nbackend = \"extractive\"\nfallback = [\"exec\", \"nope\"]\n[summarizer.exec]\ncommand = \"/bin/sh\"\n");
        assert_eq!(e.key, "summarizer.fallback[1]");
    }

    #[test]
    fn exec_needs_an_existing_command() {
        let e = build_err("[summarizer]\nbackend = \"exec\"\n");
        assert_eq!(e.key, "summarizer.exec.command");
        let e = build_err(
            "[summarizer]\nbackend = \"exec\"\n[summarizer.exec]\ncommand = \"/no/such/prog\"\n",
        );
        assert_eq!(e.key, "summarizer.exec.command");
    }

    #[test]
    fn unset_api_key_variables_are_rejected_by_key() {
        let e = build_err(
            "[summarizer.openai]\napi_key_env = \"COMPACTOR_TEST_SURELY_UNSET_VARIABLE_4711\"\n",
        );
        assert_eq!(e.key, "summarizer.openai.api_key_env");
        assert!(e
            .reason
            .contains("COMPACTOR_TEST_SURELY_UNSET_VARIABLE_4711"));
        let e = build_err(
            "[summarizer]\nbackend = \"anthropic\"\n[summarizer.anthropic]\napi_key_env = \"COMPACTOR_TEST_SURELY_UNSET_VARIABLE_4712\"\n",
        );
        assert_eq!(e.key, "summarizer.anthropic.api_key_env");
    }

    #[test]
    fn unused_backends_are_not_validated() {
        let config = Config::from_toml(
            "[summarizer]\nbackend = \"extractive\"\n[summarizer.openai]\napi_key_env = \"COMPACTOR_TEST_SURELY_UNSET_VARIABLE_4713\"\n",
        )
        .expect("config");
        assert!(build(&config, metrics()).is_ok());
    }

    #[test]
    fn bad_values_name_their_key() {
        let e = build_err("[summarizer.openai]\nbase_url = \"ftp://x\"\n");
        assert_eq!(e.key, "summarizer.openai.base_url");
        let e = build_err("[summarizer.openai]\nmax_tokens = 0\n");
        assert_eq!(e.key, "summarizer.openai.max_tokens");
        let e = build_err("[summarizer]\nbackend = \"extractive\"\n[summarizer.extractive]\nmax_message_chars = 0\n");
        assert_eq!(e.key, "summarizer.extractive.max_message_chars");
    }
}
