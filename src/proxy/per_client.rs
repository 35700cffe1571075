//! Upstream exchanges in flight per client address
//! (`server.max_upstream_per_client`).
//!
//! `client_send_timeout` ends an exchange whose client stopped reading, but
//! only after the timeout: meanwhile many connections of one client, each
//! with many HTTP/2 streams, could hold as many upstream connections (20 x
//! 100 streams held 831 of an origin's connections). So an exchange takes a
//! slot of its client's address, held until its response body has been sent
//! or dropped; a client with no slot left is answered 503 at once (as
//! nginx's `limit_conn`). IPv6 clients are counted by their /64, which one
//! client usually owns whole.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::{Arc, Mutex};

/// Shards of the table: requests of different clients seldom wait on one lock.
const SHARDS: usize = 64;

type Counts = HashMap<IpAddr, usize, foldhash::fast::FixedState>;

/// How many exchanges each client address has in flight.
pub struct PerClient {
    shards: Box<[Mutex<Counts>]>,
    hasher: foldhash::fast::FixedState,
}

impl Default for PerClient {
    fn default() -> Self {
        PerClient {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: foldhash::fast::FixedState::default(),
        }
    }
}

/// One exchange in flight; its client's count goes down when it drops.
pub struct Slot {
    table: Arc<PerClient>,
    client: IpAddr,
}

/// The address a client is counted by: IPv4 as is (an IPv4-mapped address
/// as its IPv4), IPv6 by its /64.
fn counted(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => {
            let bits = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(Ipv6Addr::from(bits))
        }
        v4 => v4,
    }
}

impl PerClient {
    fn shard(&self, client: &IpAddr) -> std::sync::MutexGuard<'_, Counts> {
        let i = self.hasher.hash_one(client) as usize % self.shards.len();
        // Nothing panics while holding the lock; a poisoned one is still sound.
        self.shards[i].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A slot for `client`, unless it has `max` exchanges in flight already.
    pub fn take(self: &Arc<Self>, client: IpAddr, max: usize) -> Option<Slot> {
        let client = counted(client);
        let mut counts = self.shard(&client);
        let n = counts.entry(client).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(Slot {
            table: self.clone(),
            client,
        })
    }

    /// The exchanges `client` has in flight (for tests).
    pub fn count(&self, client: IpAddr) -> usize {
        let client = counted(client);
        self.shard(&client).get(&client).copied().unwrap_or(0)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut counts = self.table.shard(&self.client);
        if let Some(n) = counts.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                counts.remove(&self.client);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_counted_per_address_and_given_back() {
        let table = Arc::new(PerClient::default());
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let one = table.take(a, 2).unwrap();
        let two = table.take(a, 2).unwrap();
        assert!(table.take(a, 2).is_none());
        assert!(table.take("10.0.0.2".parse().unwrap(), 2).is_some());
        drop(one);
        assert!(table.take(a, 2).is_some());
        drop(two);
        assert_eq!(table.count(a), 0);
        // An IPv6 /64 is one client; the mapped form of an IPv4 is that IPv4.
        let x: IpAddr = "2001:db8::1".parse().unwrap();
        let _s = table.take(x, 1).unwrap();
        assert!(table.take("2001:db8::ffff:1".parse().unwrap(), 1).is_none());
        let _m = table.take("::ffff:10.0.0.3".parse().unwrap(), 1).unwrap();
        assert!(table.take("10.0.0.3".parse().unwrap(), 1).is_none());
    }
}
