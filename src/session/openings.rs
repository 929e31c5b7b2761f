//! Which conversation owns a derived session id.
//!
//! A conversation without a session header is named by its opening messages. Two that open
//! alike (the same task started twice) cannot be told apart until the model's first reply,
//! and from then on must be two sessions. The first of them to reply keeps the opening's id,
//! so a conversation's id is the same on every one of its requests, its first included; a
//! later one with the same opening is named by its messages through its own first reply.
//! [`Openings`] remembers, per tenant and opening id, the conversation (named by its id
//! through the first reply) that claimed it: bounded, oldest claim forgotten first (a
//! forgotten claim is made again by whichever conversation asks next).

use std::collections::{HashMap, VecDeque};

use super::hash::TenantId;

/// Claims of opening ids, at most `capacity` of them.
#[derive(Debug)]
pub struct Openings {
    owners: HashMap<(TenantId, String), String>,
    /// Claims in the order they were made, for forgetting the oldest.
    order: VecDeque<(TenantId, String)>,
    capacity: usize,
}

impl Openings {
    /// Room for `capacity` claims (at least one).
    pub fn new(capacity: usize) -> Openings {
        Openings {
            owners: HashMap::new(),
            order: VecDeque::new(),
            capacity: capacity.max(1),
        }
    }

    /// The owner of `opening`: `candidate` if none claimed it yet (it now has).
    pub fn claim(&mut self, tenant: TenantId, opening: &str, candidate: &str) -> String {
        let key = (tenant, opening.to_string());
        if let Some(owner) = self.owners.get(&key) {
            return owner.clone();
        }
        self.remember(key, candidate.to_string());
        candidate.to_string()
    }

    /// The owner of `opening`, if known.
    pub fn owner(&self, tenant: TenantId, opening: &str) -> Option<&str> {
        self.owners
            .get(&(tenant, opening.to_string()))
            .map(String::as_str)
    }

    /// Records `owner` as the owner of `opening` (learned from a shared store).
    pub fn learn(&mut self, tenant: TenantId, opening: &str, owner: &str) {
        let key = (tenant, opening.to_string());
        match self.owners.get_mut(&key) {
            Some(known) => *known = owner.to_string(),
            None => self.remember(key, owner.to_string()),
        }
    }

    /// Claims held.
    pub fn len(&self) -> usize {
        self.owners.len()
    }

    /// Whether no claim is held.
    pub fn is_empty(&self) -> bool {
        self.owners.is_empty()
    }

    fn remember(&mut self, key: (TenantId, String), owner: String) {
        while self.owners.len() >= self.capacity {
            match self.order.pop_front() {
                Some(oldest) => {
                    self.owners.remove(&oldest);
                }
                None => break,
            }
        }
        self.order.push_back(key.clone());
        self.owners.insert(key, owner);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_claim_wins_and_the_oldest_is_forgotten_when_full() {
        let t = TenantId([7; 16]);
        let other = TenantId([8; 16]);
        let mut o = Openings::new(2);
        assert_eq!(o.claim(t, "open", "run-a"), "run-a");
        assert_eq!(
            o.claim(t, "open", "run-b"),
            "run-a",
            "taken: the first stays"
        );
        assert_eq!(o.claim(other, "open", "run-b"), "run-b", "per tenant");
        assert_eq!(o.len(), 2);
        // A third claim forgets the oldest (t's); t's opening is then claimed afresh.
        assert_eq!(o.claim(t, "second", "run-c"), "run-c");
        assert_eq!(o.len(), 2);
        assert_eq!(o.owner(t, "open"), None);
        assert_eq!(o.claim(t, "open", "run-b"), "run-b");
        o.learn(t, "open", "run-a");
        assert_eq!(o.owner(t, "open"), Some("run-a"));
        assert!(!o.is_empty());
    }
}
