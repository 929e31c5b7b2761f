//! compactor: a transparent reverse proxy for LLM chat APIs that compacts long conversations.
//!
//! Agents point their base URL at compactor. Every request is forwarded to the configured
//! upstream unchanged and every response streamed back unbuffered, except chat requests
//! (`…/chat/completions`, `…/messages`, `…/responses`): their body is read, parsed by a
//! dialect into a neutral transcript, and when the conversation passes the message count or
//! nears the model's context window, the compaction engine replaces older turns with a summary
//! written by a pluggable summarizer before forwarding. Any failure forwards the original.
//!
//! # Layout
//! Layers, bottom-up; no module imports one above it (docs/architecture.md, *Layers*;
//! `tests/layers.rs` checks it).
//! - [`config`]: the only reader of files and environment; [`timing`]: the stopwatch of the
//!   time compactor itself adds to a request; [`process`]: this process's resource use, read
//!   from `/proc` for `/metrics`.
//! - [`transcript`] and [`estimate`]: the base layer: the neutral conversation model and the
//!   token estimate; [`cohort`]: which conversations are compacted, watched or left alone.
//! - [`dialect`]: one module per wire format, read in one scan and written back by splicing
//!   bytes; beside it, importing neither way, [`compaction`]: the engine (trigger, boundary,
//!   mask, prompt, files, engine).
//! - [`session`]: canonical JSON, chain hashing, checkpoints, session stores, single flight,
//!   per-session breaker; [`metrics`]: the only place that names metrics; [`calibration`]:
//!   per-model moving ratio of actual to estimated input tokens; [`event_log`]: one JSON line
//!   per compaction, mask step, retry and failure (`server.event_log`).
//! - [`pipeline`]: the request-level flow: scan, checkpoint lookup, single flight, splice,
//!   store; [`usage`]: response bodies passed through unbuffered while their `usage` is read;
//!   [`summarizer`]: the one place that maps backend names to summarizer plugins;
//!   [`overflow`]: a provider's refusal of a request for its length, recognised.
//! - [`proxy`]: the only place that orders the steps of a request; [`admin`]: `/metrics`,
//!   `/livez`, `/readyz`, the sessions API; [`server`]: listeners, accept loops, TLS, graceful
//!   shutdown; [`app`]: the application value a request needs, swapped whole on reload;
//!   [`reload`]: hot reload; [`upstream`]: pooled HTTP client, URI/Host rewrite, hop-by-hop
//!   headers; [`error`]: the error enum whose variants know their HTTP status; [`replay`] and
//!   [`compact_once`]: the offline tools; [`run`]: an agent started through compactor.

pub mod admin;
pub mod app;
pub mod budget;
pub mod calibration;
pub mod cohort;
pub mod compact_once;
pub mod compaction;
pub mod config;
pub mod cost;
pub mod dialect;
pub mod error;
pub mod estimate;
pub mod event_log;
pub mod metrics;
pub mod overflow;
pub mod pipeline;
pub mod process;
pub mod proxy;
pub mod reload;
pub mod replay;
pub mod run;
pub mod server;
pub mod session;
pub mod summarizer;
#[cfg(test)]
pub(crate) mod testing;
pub mod timing;
pub mod transcript;
pub mod upstream;
pub mod usage;

pub use app::App;
pub use config::Config;
pub use server::Server;
