//! Who is asking: the client address, and the identity values limits count by.
//!
//! The client address is the TCP peer, unless the peer is a trusted proxy: then it
//! is the rightmost `X-Forwarded-For` entry that is not itself trusted (entries to
//! the left of it were written by the client and prove nothing). An IPv4-mapped
//! IPv6 address (`::ffff:192.0.2.1`) is always its IPv4 address.
//!
//! An identity is a key spec and a value. One request may give a spec several
//! values: a header sent twice, or listing values with commas, and a query
//! parameter given twice (`&` or `;` between pairs) count every distinct value,
//! and the request passes only if every one passes. Backends disagree on which
//! copy they read (Go's `Header.Get` and `Query().Get` take the first, Django
//! the last, Rack may join them): counting all of them leaves no copy uncounted,
//! and no extra copy buys a fresh budget. Values are compared as bytes, never
//! through a lossy text conversion.
//!
//! A header or query key whose values are all missing or empty falls back to
//! the client address, counted under the spec `ip`, so that a client sending
//! `X-Api-Key: 203.0.113.9` shares nothing with the address 203.0.113.9.
//!
//! An IPv6 address is counted by its network of the policy's `ipv6_prefix`
//! bits (64 by default): a client usually holds a whole /64 and could
//! otherwise take a fresh budget from each of its addresses.

use std::net::IpAddr;

use ipnet::IpNet;
use smallvec::SmallVec;

use crate::config::KeySpec;
use crate::fields::{self, Fields};

/// The most distinct values one key spec may take from one request. Each is
/// a counter set of its own in the store's call: a request naming more is
/// refused (400) rather than let it cost the store a call of any size.
pub const MAX_VALUES: usize = 16;

/// A request gave one key spec more than [`MAX_VALUES`] distinct values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a request names more than 16 distinct values for one rate-limit key")]
pub struct TooManyValues;

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

/// Whether `ip` (in its canonical form) is in `trusted`.
pub fn is_trusted(ip: IpAddr, trusted: &[IpNet]) -> bool {
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

/// An IPv4-mapped IPv6 range (`::ffff:10.0.0.0/104`) as the IPv4 range it
/// names (`10.0.0.0/8`); any other range as it is. Client addresses are
/// compared in their IPv4 form, so a mapped range would never match.
pub fn canonical_net(net: IpNet) -> IpNet {
    match net {
        IpNet::V6(v6) if v6.prefix_len() >= 96 => match v6.network().to_ipv4_mapped() {
            Some(v4) => ipnet::Ipv4Net::new(v4, v6.prefix_len() - 96)
                .map(IpNet::V4)
                .unwrap_or(net),
            None => net,
        },
        _ => net,
    }
}

/// One identity: the spec it is counted under (after any fallback) and one
/// value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub spec: KeySpec,
    pub value: Vec<u8>,
}

/// The distinct values one key spec takes from a request, in order of first
/// appearance, without copies and without empty ones. Kept as one buffer
/// (each value a 4-byte length, then its bytes), so that a connection can
/// compare a request's values with its last request's without allocating.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Values {
    buf: Vec<u8>,
    count: usize,
}

impl Values {
    pub fn clear(&mut self) {
        self.buf.clear();
        self.count = 0;
    }

    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The values, in order.
    pub fn iter(&self) -> impl Iterator<Item = &[u8]> {
        let mut rest = &self.buf[..];
        std::iter::from_fn(move || {
            let (len, tail) = rest.split_first_chunk::<4>()?;
            let len = u32::from_le_bytes(*len) as usize;
            let (value, tail) = tail.split_at(len.min(tail.len()));
            rest = tail;
            Some(value)
        })
    }

    /// Adds `value` unless it is empty or already there.
    fn push(&mut self, value: &[u8]) -> Result<(), TooManyValues> {
        if value.is_empty() || self.iter().any(|v| v == value) {
            return Ok(());
        }
        if self.count == MAX_VALUES {
            return Err(TooManyValues);
        }
        let len = u32::try_from(value.len()).map_err(|_| TooManyValues)?;
        self.buf.extend_from_slice(&len.to_le_bytes());
        self.buf.extend_from_slice(value);
        self.count += 1;
        Ok(())
    }
}

/// The identities of `spec` for a request (see the module's doc): the spec
/// they are counted under (after any fallback) and their values, one for
/// `ip` and `global`, one per distinct value for a header or query key.
pub fn identify(
    spec: &KeySpec,
    client: IpAddr,
    ipv6_prefix: u8,
    headers: Fields<'_>,
    query: Option<&str>,
) -> Result<(KeySpec, Values), TooManyValues> {
    let mut values = Values::default();
    let spec = identify_into(spec, client, ipv6_prefix, headers, query, &mut values)?;
    Ok((spec.clone(), values))
}

/// [`identify`] into `out` (emptied first), without allocating once `out`
/// has room: returns the spec the values are counted under. `global` gets
/// one empty value.
pub fn identify_into<'a>(
    spec: &'a KeySpec,
    client: IpAddr,
    ipv6_prefix: u8,
    headers: Fields<'_>,
    query: Option<&str>,
    out: &mut Values,
) -> Result<&'a KeySpec, TooManyValues> {
    static IP: KeySpec = KeySpec::Ip;
    out.clear();
    match spec {
        KeySpec::Ip => {}
        KeySpec::Global => {
            out.buf.extend_from_slice(&0u32.to_le_bytes());
            out.count = 1;
            return Ok(spec);
        }
        KeySpec::Header(name) => push_header_values(out, headers, name)?,
        KeySpec::Query(name) => {
            if let Some(q) = query {
                push_query_values(out, q.as_bytes(), name.as_bytes())?;
            }
        }
    }
    if !out.is_empty() {
        return Ok(spec);
    }
    // Written in place: `out` is empty, so this is its one value.
    out.buf.extend_from_slice(&[0; 4]);
    push_client_text(&mut out.buf, client, ipv6_prefix);
    let len = (out.buf.len() - 4) as u32;
    out.buf[..4].copy_from_slice(&len.to_le_bytes());
    out.count = 1;
    Ok(&IP)
}

/// The value an `ip` identity has for `client`: its IPv4 address, or the
/// network of its IPv6 address of `ipv6_prefix` bits (`2001:db8:1:2::/64`;
/// the address alone when the prefix is 128).
pub fn push_client_text(out: &mut Vec<u8>, client: IpAddr, ipv6_prefix: u8) {
    match client.to_canonical() {
        IpAddr::V4(v4) => push_ip_text(out, IpAddr::V4(v4)),
        IpAddr::V6(v6) if ipv6_prefix >= 128 => push_ip_text(out, IpAddr::V6(v6)),
        IpAddr::V6(v6) => {
            let net = ipnet::Ipv6Net::new(v6, ipv6_prefix)
                .map(|n| n.trunc())
                .unwrap_or_else(|_| ipnet::Ipv6Net::from(v6));
            out.extend_from_slice(net.to_string().as_bytes());
        }
    }
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

/// Adds every value of every line of a header: each line split at its
/// commas (HTTP's list syntax, RFC 9110 5.3), each element without the
/// spaces around it.
fn push_header_values(
    out: &mut Values,
    headers: Fields<'_>,
    name: &http::HeaderName,
) -> Result<(), TooManyValues> {
    for line in headers.values(name) {
        for element in line.split(|&b| b == b',') {
            out.push(trim_ows(element))?;
        }
    }
    Ok(())
}

fn trim_ows(mut v: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = v {
        v = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = v {
        v = rest;
    }
    v
}

/// Adds the value of every pair of the query named `name`: pairs split at
/// `&` and at `;` (as Rack and older CGI parsers do), names and values
/// form-decoded (`+` is a space, `%XX` a byte; a `%` that starts no escape
/// is itself) to bytes.
fn push_query_values(out: &mut Values, query: &[u8], name: &[u8]) -> Result<(), TooManyValues> {
    let mut decoded_name = SmallVec::<[u8; 32]>::new();
    let mut decoded_value = SmallVec::<[u8; 64]>::new();
    for pair in query.split(|&b| b == b'&' || b == b';') {
        let (n, v) = match pair.iter().position(|&b| b == b'=') {
            Some(at) => (&pair[..at], &pair[at + 1..]),
            None => (pair, &pair[pair.len()..]),
        };
        if v.is_empty() {
            continue;
        }
        decoded_name.clear();
        form_decode(n, &mut decoded_name);
        if decoded_name[..] != *name {
            continue;
        }
        decoded_value.clear();
        form_decode(v, &mut decoded_value);
        out.push(&decoded_value)?;
    }
    Ok(())
}

/// The first value of the query parameter `name`, as bytes (`None` when it
/// has none that is not empty).
pub fn query_value(query: &[u8], name: &[u8]) -> Option<Vec<u8>> {
    let mut values = Values::default();
    // Past MAX_VALUES the first one is already in.
    let _ = push_query_values(&mut values, query, name);
    values.iter().next().map(<[u8]>::to_vec)
}

/// `application/x-www-form-urlencoded` decoding to bytes.
fn form_decode<O: Extend<u8>>(input: &[u8], out: &mut O) {
    let hex = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
    let mut i = 0;
    while i < input.len() {
        let b = input[i];
        let escape = (b == b'%')
            .then(|| Some((hex(*input.get(i + 1)?)?, hex(*input.get(i + 2)?)?)))
            .flatten();
        match (b, escape) {
            (_, Some((h, l))) => {
                out.extend([h << 4 | l]);
                i += 3;
            }
            (b'+', _) => {
                out.extend([b' ']);
                i += 1;
            }
            _ => {
                out.extend([b]);
                i += 1;
            }
        }
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

    fn values(spec: &KeySpec, headers: Fields<'_>, query: Option<&str>) -> (KeySpec, Vec<Vec<u8>>) {
        let (spec, values) =
            identify(spec, ip("192.0.2.1"), 64, headers, query).expect("few values");
        (spec, values.iter().map(<[u8]>::to_vec).collect())
    }

    #[test]
    fn each_distinct_header_value_is_an_identity() {
        let spec = KeySpec::Header(http::HeaderName::from_static("x-user"));
        let mut h = HeaderMap::new();
        assert_eq!(values(&spec, Fields::Map(&h), None).0, KeySpec::Ip);
        h.append("x-user", "".parse().unwrap());
        h.append("x-user", " , ".parse().unwrap());
        assert_eq!(
            values(&spec, Fields::Map(&h), None),
            (KeySpec::Ip, vec![b"192.0.2.1".to_vec()])
        );
        let mut h = HeaderMap::new();
        h.append("x-user", "a".parse().unwrap());
        h.append("x-user", "b,a , c".parse().unwrap());
        h.append("x-user", "a".parse().unwrap());
        let want: Vec<Vec<u8>> = vec![b"a".to_vec(), b"b".to_vec(), b"c".to_vec()];
        assert_eq!(values(&spec, Fields::Map(&h), None), (spec.clone(), want));
        // The same key twice is the same identity as once.
        let mut twice = HeaderMap::new();
        twice.append("x-user", "k".parse().unwrap());
        twice.append("x-user", "k".parse().unwrap());
        assert_eq!(values(&spec, Fields::Map(&twice), None).1, [b"k".to_vec()]);
    }

    #[test]
    fn query_values_split_on_both_separators_and_decode_to_bytes() {
        let spec = KeySpec::Query("key".to_string());
        let h = HeaderMap::new();
        let (_, v) = values(
            &spec,
            Fields::Map(&h),
            Some("x=1&key=a%20b;k%65y=c+d&key=a%20b"),
        );
        assert_eq!(v, [b"a b".to_vec(), b"c d".to_vec()]);
        assert_eq!(
            values(&spec, Fields::Map(&h), Some("key=&key")).0,
            KeySpec::Ip
        );
        // Bytes that are not UTF-8 stay apart.
        let (_, v) = values(&spec, Fields::Map(&h), Some("key=%FF&key=%FE&key=%zz"));
        assert_eq!(v, [vec![0xFF], vec![0xFE], b"%zz".to_vec()]);
    }

    #[test]
    fn too_many_values_are_refused() {
        let spec = KeySpec::Query("k".to_string());
        let h = HeaderMap::new();
        let q: Vec<String> = (0..=MAX_VALUES).map(|i| format!("k={i}")).collect();
        let ok = q[..MAX_VALUES].join("&");
        assert!(identify(&spec, ip("192.0.2.1"), 64, Fields::Map(&h), Some(&ok)).is_ok());
        let q = q.join("&");
        assert_eq!(
            identify(&spec, ip("192.0.2.1"), 64, Fields::Map(&h), Some(&q)).err(),
            Some(TooManyValues)
        );
    }

    #[test]
    fn ipv6_clients_are_counted_by_prefix_and_mapped_ones_as_ipv4() {
        let h = HeaderMap::new();
        let id = |addr: &str, prefix: u8| {
            let (_, values) =
                identify(&KeySpec::Ip, ip(addr), prefix, Fields::Map(&h), None).expect("one value");
            values.iter().next().map(<[u8]>::to_vec).unwrap_or_default()
        };
        assert_eq!(id("2001:db8:1:2::1", 64), b"2001:db8:1:2::/64");
        assert_eq!(id("2001:db8:1:2:ffff::9", 64), b"2001:db8:1:2::/64");
        assert_eq!(id("2001:db8:1:2::1", 48), b"2001:db8:1::/48");
        assert_eq!(id("2001:db8:1:2::1", 128), b"2001:db8:1:2::1");
        assert_eq!(id("::ffff:192.0.2.7", 64), b"192.0.2.7");
        assert_eq!(id("192.0.2.7", 64), b"192.0.2.7");
    }

    #[test]
    fn mapped_ranges_are_their_ipv4_ranges() {
        let net = |s: &str| s.parse::<IpNet>().unwrap();
        assert_eq!(canonical_net(net("::ffff:10.0.0.0/104")), net("10.0.0.0/8"));
        assert_eq!(
            canonical_net(net("::ffff:192.0.2.1/128")),
            net("192.0.2.1/32")
        );
        assert_eq!(canonical_net(net("2001:db8::/32")), net("2001:db8::/32"));
        let trusted = vec![canonical_net(net("::ffff:10.0.0.0/104"))];
        let h = xff(&["198.51.100.1"]);
        assert_eq!(
            client_ip(ip("::ffff:10.1.2.3"), Fields::Map(&h), &trusted),
            ip("198.51.100.1")
        );
    }
}
