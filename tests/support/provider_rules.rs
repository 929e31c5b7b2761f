//! Strict mock providers: a mock upstream that answers a request valid for the provider and
//! refuses anything else with the provider's 400, counting refusals by kind. The rules
//! themselves live in `compactor-plugin-testing` (`rules`); the Chat Completions ones are
//! re-exported here.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::Value;

use super::mock::{MockUpstream, Recorded, Reply};

pub use compactor_plugin_testing::rules::chat::{chat_tokens, check_chat, rejection_body};
pub use compactor_plugin_testing::rules::Rejection;

/// What a strict mock provider refused, by kind, with the reasons for the failure message.
#[derive(Default)]
pub struct Refusals {
    invalid: AtomicUsize,
    context_length: AtomicUsize,
    reasons: Mutex<Vec<String>>,
}

impl Refusals {
    /// Counts one refusal.
    pub fn record(&self, rejection: &Rejection) {
        match rejection {
            Rejection::Invalid(_) => self.invalid.fetch_add(1, Ordering::SeqCst),
            Rejection::ContextLength { .. } => self.context_length.fetch_add(1, Ordering::SeqCst),
        };
        self.reasons
            .lock()
            .expect("lock")
            .push(format!("{rejection:?}"));
    }

    /// Requests refused as malformed.
    pub fn invalid(&self) -> usize {
        self.invalid.load(Ordering::SeqCst)
    }

    /// Requests refused for not fitting the window.
    pub fn context_length(&self) -> usize {
        self.context_length.load(Ordering::SeqCst)
    }

    /// Every refusal so far, in order.
    pub fn reasons(&self) -> Vec<String> {
        self.reasons.lock().expect("lock").clone()
    }
}

/// A provider's rules: its endpoint path, its validation (the request and the window of the
/// model it names) and its error body.
pub struct Provider {
    pub path: &'static str,
    pub check: fn(&Value) -> Result<(), Rejection>,
    pub rejection_body: fn(&Rejection) -> Value,
}

/// Makes `mock` a strict provider: a valid request to `provider.path` gets `ok`; anything
/// else gets the provider's 400 and is counted in the returned [`Refusals`].
pub fn strict_provider(mock: &MockUpstream, provider: Provider, ok: Value) -> Arc<Refusals> {
    let refusals = Arc::new(Refusals::default());
    let r = refusals.clone();
    mock.set_handler(move |req: &Recorded| {
        let verdict = match serde_json::from_slice::<Value>(&req.body) {
            Ok(v) if req.path() == provider.path => (provider.check)(&v),
            Ok(_) => Err(Rejection::Invalid(format!(
                "unexpected path {}",
                req.path()
            ))),
            Err(e) => Err(Rejection::Invalid(format!("invalid JSON: {e}"))),
        };
        match verdict {
            Ok(()) => Reply::json(200, &ok),
            Err(rejection) => {
                r.record(&rejection);
                Reply::json(400, &(provider.rejection_body)(&rejection))
            }
        }
    });
    refusals
}
