//! Who is asking: the client address, and the identity values limits count by.
//!
//! The client address is the TCP peer, unless the peer is a trusted proxy: then it
//! is the rightmost `X-Forwarded-For` entry that is not itself trusted (entries to
//! the left of it were written by the client and prove nothing).
//!
//! An identity is a key spec and a value. A header or query key whose value is
//! missing or empty falls back to the client address, counted under the spec
//! `ip`, so that a client sending `X-Api-Key: 203.0.113.9` shares nothing with the
//! address 203.0.113.9.

use std::net::IpAddr;

use ipnet::IpNet;
use smallvec::SmallVec;

use crate::config::KeySpec;
use crate::fields::{self, Fields};

/// The client address for a request arriving from `peer`.
pub fn client_ip(peer: IpAddr, headers: Fields<'_>, trusted: &[IpNet]) -> IpAddr {
    let peer = peer.to_canonical();
    if !is_trusted(peer, trusted) {
        return peer;
    }
    // Walk the hops right to left across every X-Forwarded-For line, in order.
    static XFF: http::HeaderName = http::HeaderName::from_static("x-forwarded-for");
    let lines: SmallVec<[&[u8]; 4]> = headers.values(&XFF).collect();
    for line in lines.iter().rev() {
        let Some(text) = fields::text(line) else {
            return peer;
        };
        for hop in text.rsplit(',') {
            let hop = hop.trim();
            if hop.is_empty() {
                continue;
            }
            let Some(ip) = parse_hop(hop) else {
                return peer;
            };
            if !is_trusted(ip, trusted) {
                return ip;
            }
        }
    }
    peer
}

fn is_trusted(ip: IpAddr, trusted: &[IpNet]) -> bool {
    trusted.iter().any(|net| net.contains(&ip))
}

/// An X-Forwarded-For hop: `1.2.3.4`, `1.2.3.4:5678`, `::1` or `[::1]:5678`.
fn parse_hop(hop: &str) -> Option<IpAddr> {
    if let Ok(ip) = hop.parse::<IpAddr>() {
        return Some(ip.to_canonical());
    }
    if let Ok(sa) = hop.parse::<std::net::SocketAddr>() {
        return Some(sa.ip().to_canonical());
    }
    None
}

/// The identity a key spec yields for one request: the spec it was counted
/// under (after any fallback) and the value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub spec: KeySpec,
    pub value: Vec<u8>,
}

/// The identity of `spec` for a request.
pub fn identify(
    spec: &KeySpec,
    client: IpAddr,
    headers: Fields<'_>,
    query: Option<&str>,
) -> Identity {
    let mut value = Vec::new();
    let spec = identify_into(spec, client, headers, query, &mut value).clone();
    Identity { spec, value }
}

/// [`identify`] without allocating: writes the value into `out` (emptied
/// first) and returns the spec it is counted under.
pub fn identify_into<'a>(
    spec: &'a KeySpec,
    client: IpAddr,
    headers: Fields<'_>,
    query: Option<&str>,
    out: &mut Vec<u8>,
) -> &'a KeySpec {
    static IP: KeySpec = KeySpec::Ip;
    out.clear();
    match spec {
        KeySpec::Ip => {}
        KeySpec::Global => return spec,
        KeySpec::Header(name) => push_header_value(out, headers, name),
        KeySpec::Query(name) => {
            if let Some(q) = query {
                push_query_value(out, q, name);
            }
        }
    }
    if !out.is_empty() {
        return spec;
    }
    push_ip_text(out, client);
    &IP
}

/// Appends the address as `Display` writes it; IPv4, the usual case, without
/// the formatting machinery.
pub fn push_ip_text(out: &mut Vec<u8>, ip: IpAddr) {
    let IpAddr::V4(v4) = ip else {
        out.extend_from_slice(ip.to_string().as_bytes());
        return;
    };
    // Written on the stack, then copied once: a push per digit checked the
    // vector's capacity each time.
    let mut text = [0u8; 15];
    let mut n = 0;
    for (i, octet) in v4.octets().into_iter().enumerate() {
        if i > 0 {
            text[n] = b'.';
            n += 1;
        }
        if octet >= 100 {
            text[n] = b'0' + octet / 100;
            n += 1;
        }
        if octet >= 10 {
            text[n] = b'0' + octet / 10 % 10;
            n += 1;
        }
        text[n] = b'0' + octet % 10;
        n += 1;
    }
    out.extend_from_slice(&text[..n]);
}

/// Appends all values of a header, joined with ", " as HTTP defines: a second
/// copy of the header makes a different identity, never a fresh copy of the
/// first.
fn push_header_value(out: &mut Vec<u8>, headers: Fields<'_>, name: &http::HeaderName) {
    for (i, v) in headers.values(name).enumerate() {
        if i > 0 {
            out.extend_from_slice(b", ");
        }
        out.extend_from_slice(v);
    }
}

/// Appends all values of a query parameter, percent-decoded and joined with ", ".
fn push_query_value(out: &mut Vec<u8>, query: &str, name: &str) {
    let values = form_urlencoded::parse(query.as_bytes()).filter(|(k, _)| k == name);
    for (i, (_, v)) in values.enumerate() {
        if i > 0 {
            out.extend_from_slice(b", ");
        }
        out.extend_from_slice(v.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderMap;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn ip_text(ip: IpAddr) -> Vec<u8> {
        let mut out = Vec::new();
        push_ip_text(&mut out, ip);
        out
    }

    #[test]
    fn ip_text_writes_what_display_writes() {
        // Keys hash this text: it must never change for a given address.
        for a in [0u8, 1, 9, 10, 99, 100, 199, 200, 255] {
            for b in [0u8, 7, 42, 250] {
                let addr = IpAddr::from([a, b, 255 - a, b / 2]);
                assert_eq!(ip_text(addr), addr.to_string().into_bytes());
            }
        }
        let v6 = ip("2001:db8::1");
        assert_eq!(ip_text(v6), b"2001:db8::1".to_vec());
    }

    fn xff(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append("x-forwarded-for", v.parse().unwrap());
        }
        h
    }

    #[test]
    fn untrusted_peer_cannot_spoof() {
        let trusted = vec!["10.0.0.0/8".parse().unwrap()];
        let h = xff(&["1.2.3.4"]);
        assert_eq!(
            client_ip(ip("203.0.113.5"), Fields::Map(&h), &trusted),
            ip("203.0.113.5")
        );
    }

    #[test]
    fn trusted_peer_gives_rightmost_untrusted_hop() {
        let trusted = vec!["10.0.0.0/8".parse().unwrap()];
        let h = xff(&["6.6.6.6, 1.2.3.4", "10.0.0.2"]);
        assert_eq!(
            client_ip(ip("10.0.0.1"), Fields::Map(&h), &trusted),
            ip("1.2.3.4")
        );
        // All hops trusted: the leftmost is as far as we can see; here the peer.
        let h = xff(&["10.1.1.1"]);
        assert_eq!(
            client_ip(ip("10.0.0.1"), Fields::Map(&h), &trusted),
            ip("10.0.0.1")
        );
        // Garbage ends the walk at the last address we can vouch for.
        let h = xff(&["1.2.3.4, nonsense"]);
        assert_eq!(
            client_ip(ip("10.0.0.1"), Fields::Map(&h), &trusted),
            ip("10.0.0.1")
        );
        let h = xff(&["[2001:db8::1]:443"]);
        assert_eq!(
            client_ip(ip("10.0.0.1"), Fields::Map(&h), &trusted),
            ip("2001:db8::1")
        );
    }

    #[test]
    fn header_values_join_and_fall_back() {
        let spec = KeySpec::Header(http::HeaderName::from_static("x-user"));
        let client = ip("192.0.2.1");
        let mut h = HeaderMap::new();
        assert_eq!(
            identify(&spec, client, Fields::Map(&h), None).spec,
            KeySpec::Ip
        );
        h.append("x-user", "".parse().unwrap());
        assert_eq!(
            identify(&spec, client, Fields::Map(&h), None).spec,
            KeySpec::Ip
        );
        let mut h = HeaderMap::new();
        h.append("x-user", "a".parse().unwrap());
        h.append("x-user", "b".parse().unwrap());
        assert_eq!(
            identify(&spec, client, Fields::Map(&h), None).value,
            b"a, b"
        );
    }

    #[test]
    fn query_values_decode() {
        let spec = KeySpec::Query("key".to_string());
        let client = ip("192.0.2.1");
        let h = HeaderMap::new();
        let id = identify(&spec, client, Fields::Map(&h), Some("x=1&key=a%20b"));
        assert_eq!(id.value, b"a b");
        assert_eq!(
            identify(&spec, client, Fields::Map(&h), Some("key=")).spec,
            KeySpec::Ip
        );
    }
}
