//! Sessions in a stateless proxy: recognising a conversation across requests and remembering
//! what was already compacted (docs/architecture.md, *Sessions in a stateless proxy*).
//!
//! Providers are stateless and agents resend the whole history, so compactor identifies a
//! conversation prefix by content ([`hash`]: canonical JSON ([`canonical`]) chained per message
//! from a tenant hash, with [`memo`] remembering the hashes of histories already seen),
//! remembers "the first *k* messages are replaced by summary *S*" as checkpoints in a
//! [`SessionStore`] ([`store`] is the contract, [`memory`] the bounded in-memory backend,
//! [`redis`] the one replicas share), makes sure one prefix is compacted once at a time
//! ([`flight`]; across replicas, the store's claims), and stops compacting a session whose
//! compactions keep failing ([`breaker`]). The store also keeps the context windows providers
//! revealed per model ([`windows`]), so they are shared wherever the store is. These are
//! primitives: the proxy and the compaction engine decide when to use them.

pub mod breaker;
pub mod canonical;
pub mod flight;
pub mod hash;
pub mod memo;
pub mod memory;
pub mod openings;
pub mod redis;
pub mod store;
pub mod windows;

pub use breaker::{Breaker, BreakerState, SESSION_BREAKER_THRESHOLD};
pub use flight::{Flight, FlightError, SingleFlight};
pub use hash::{
    canonical_json, chain, derived_session_ids, session_id, CanonicalError, ChainHash, TenantId,
};
pub use memo::{ChainMemo, SessionIdMemo};
pub use memory::{Clock, MemoryStore};
pub use redis::{RedisSettings, RedisStore};
pub use store::{
    Checkpoint, Claim, LatestRequest, Lease, MaskFloor, MaskNeed, ProviderAnswer, SessionCost,
    SessionInfo, SessionStore, Staged, StoreError, StoreHealth, StoreLimits, StoreStats,
};
