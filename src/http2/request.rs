//! A request's head from its header block's fields (RFC 9113, 8.2 and
//! 8.3): pseudo-header fields checked and made into the method and URI,
//! the other fields kept, a malformed request told apart.

use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Uri};

/// Why a request is malformed (RFC 9113, 8.1.1): the stream is reset with
/// PROTOCOL_ERROR; the connection goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("malformed HTTP/2 request: {0}")]
pub struct Malformed(pub &'static str);

/// A request's head, read from its fields.
#[derive(Debug)]
pub struct Head {
    pub method: Method,
    pub uri: Uri,
    pub headers: HeaderMap,
}

/// Takes a header block's fields one by one (see [`hpack::Decoder`]).
///
/// Three kinds of fault are told apart, as h2 tells them: a field that is
/// no field at all ([`Fields::invalid`]: the connection ends); a block
/// that is malformed whatever it is for ([`Fields::malformed_block`]:
/// pseudo-header fields repeated or after a regular one, a
/// connection-specific field; the stream is reset); and a request that is
/// malformed ([`Fields::finish`]: the stream is reset once opened).
///
/// [`hpack::Decoder`]: super::hpack::Decoder
pub struct Fields {
    /// The pseudo-header fields, as they came: `:method`, `:scheme`,
    /// `:authority`, `:path`, `:status`, `:protocol`.
    pseudo: [Option<Vec<u8>>; 6],
    headers: HeaderMap,
    /// A regular field has come: pseudo-header fields may not follow.
    regular: bool,
    /// Why the block is malformed, whatever it is for.
    malformed: Option<&'static str>,
    /// A field that is no field at all came.
    invalid: bool,
    /// The header list's size as SETTINGS_MAX_HEADER_LIST_SIZE counts it
    /// (each field's name and value, plus 32).
    size: usize,
    limit: usize,
}

const PSEUDO: [&[u8]; 6] = [
    b"method",
    b"scheme",
    b"authority",
    b"path",
    b"status",
    b"protocol",
];

impl Fields {
    /// Fields of a request whose header list may be `limit` bytes long.
    pub fn new(limit: usize) -> Fields {
        Fields {
            pseudo: Default::default(),
            headers: HeaderMap::new(),
            regular: false,
            malformed: None,
            invalid: false,
            size: 0,
            limit,
        }
    }

    fn malformed(&mut self, why: &'static str) {
        self.malformed.get_or_insert(why);
    }

    /// Takes one field. Past the size limit, fields are only checked and
    /// counted.
    pub fn field(&mut self, name: &[u8], value: &[u8]) {
        if !valid(name, value) {
            self.invalid = true;
            return;
        }
        if let Some(pseudo) = name.strip_prefix(b":") {
            let Some(i) = PSEUDO.iter().position(|p| *p == pseudo) else {
                return;
            };
            if self.regular {
                return self.malformed("a pseudo-header field after a regular one");
            }
            if self.pseudo[i].is_some() {
                return self.malformed("a pseudo-header field twice");
            }
            self.count(name, value);
            if !self.too_large() {
                self.pseudo[i] = Some(value.to_vec());
            }
            return;
        }
        // Connection-specific fields (8.2.2) are not counted.
        match name {
            b"connection" | b"keep-alive" | b"proxy-connection" | b"transfer-encoding"
            | b"upgrade" => {
                return self.malformed("a connection-specific field");
            }
            b"te" if value != b"trailers" => return self.malformed("TE other than \"trailers\""),
            _ => {}
        }
        self.regular = true;
        self.count(name, value);
        if self.too_large() {
            return;
        }
        if let (Ok(name), Ok(value)) =
            (HeaderName::from_bytes(name), HeaderValue::from_bytes(value))
        {
            self.headers.append(name, value);
        }
    }

    fn count(&mut self, name: &[u8], value: &[u8]) {
        self.size = self.size.saturating_add(name.len() + value.len() + 32);
    }

    /// The block is malformed, whatever it is for: the stream is reset
    /// (and, as h2 does it, not opened).
    pub fn malformed_block(&self) -> bool {
        self.malformed.is_some()
    }

    /// A field was no field at all: a name that is not a lowercase token,
    /// a value with a control byte, an unknown pseudo-header field, a
    /// method that is not a token, a target that is not UTF-8. h2 ends the
    /// connection for these (PROTOCOL_ERROR) rather than the stream alone,
    /// and so does sluice: they are no mistake a real client makes.
    pub fn invalid(&self) -> bool {
        self.invalid
    }

    /// The header list was over the limit.
    pub fn too_large(&self) -> bool {
        self.size > self.limit
    }

    /// The request's head, once the block has ended.
    pub fn finish(self) -> Result<Head, Malformed> {
        if let Some(why) = self.malformed {
            return Err(Malformed(why));
        }
        let [method, scheme, authority, path, status, protocol] = self.pseudo;
        if status.is_some() {
            return Err(Malformed(":status in a request"));
        }
        if protocol.is_some() {
            // Extended CONNECT (RFC 8441) is not offered.
            return Err(Malformed(":protocol"));
        }
        let method = method.ok_or(Malformed("no :method"))?;
        let method = Method::from_bytes(&method).map_err(|_| Malformed("an invalid :method"))?;
        let mut parts = http::uri::Parts::default();
        if let Some(a) = authority {
            parts.authority =
                Some(Authority::try_from(a).map_err(|_| Malformed("an invalid :authority"))?);
        }
        if method == Method::CONNECT {
            // CONNECT names an authority only (8.5).
            if scheme.is_some() || path.is_some() {
                return Err(Malformed(":scheme or :path in CONNECT"));
            }
            if parts.authority.is_none() {
                return Err(Malformed("CONNECT without :authority"));
            }
        } else {
            let scheme = scheme.ok_or(Malformed("no :scheme"))?;
            let scheme =
                Scheme::try_from(&scheme[..]).map_err(|_| Malformed("an invalid :scheme"))?;
            // A URI has a scheme only with an authority.
            if parts.authority.is_some() {
                parts.scheme = Some(scheme);
            }
            let path = path.ok_or(Malformed("no :path"))?;
            if path.is_empty() {
                return Err(Malformed("an empty :path"));
            }
            parts.path_and_query =
                Some(PathAndQuery::try_from(path).map_err(|_| Malformed("an invalid :path"))?);
        }
        let uri = Uri::from_parts(parts).map_err(|_| Malformed("an invalid request target"))?;
        Ok(Head {
            method,
            uri,
            headers: self.headers,
        })
    }
}

impl Fields {
    /// A trailer section's fields (8.1): no pseudo-header field.
    pub fn finish_trailers(self) -> Result<HeaderMap, Malformed> {
        if let Some(why) = self.malformed {
            return Err(Malformed(why));
        }
        if self.pseudo.iter().any(Option::is_some) {
            return Err(Malformed("a pseudo-header field in trailers"));
        }
        Ok(self.headers)
    }
}

/// Whether a field is one at all (see [`Fields::invalid`]).
fn valid(name: &[u8], value: &[u8]) -> bool {
    match name.strip_prefix(b":") {
        Some(b"method") => Method::from_bytes(value).is_ok(),
        Some(b"status") => http::StatusCode::from_bytes(value).is_ok(),
        Some(b"authority" | b"scheme" | b"path" | b"protocol") => {
            std::str::from_utf8(value).is_ok()
        }
        Some(_) => false,
        None => {
            !name.is_empty()
                && name.iter().all(|&b| TOKEN_LOWER[usize::from(b)])
                && valid_value(value)
        }
    }
}

/// A field value's bytes (RFC 9110, 5.5; RFC 9113, 8.2.1): no NUL, CR or
/// LF, nor other controls but tab.
fn valid_value(value: &[u8]) -> bool {
    value
        .iter()
        .all(|&b| b == b'\t' || (b >= 0x20 && b != 0x7f))
}

/// The bytes of a lowercase field name: tchar (RFC 9110, 5.6.2) without
/// uppercase letters.
const TOKEN_LOWER: [bool; 256] = {
    let mut t = [false; 256];
    let extra = b"!#$%&'*+-.^_`|~";
    let mut i = 0;
    while i < extra.len() {
        t[extra[i] as usize] = true;
        i += 1;
    }
    let mut b = b'0';
    while b <= b'9' {
        t[b as usize] = true;
        b += 1;
    }
    let mut b = b'a';
    while b <= b'z' {
        t[b as usize] = true;
        b += 1;
    }
    t
};

#[cfg(test)]
mod tests {
    use super::*;

    /// The head, or why not: `Err(None)` for an invalid field.
    fn read(fields: &[(&str, &str)]) -> Result<Head, Option<Malformed>> {
        let mut f = Fields::new(16 * 1024);
        for (n, v) in fields {
            f.field(n.as_bytes(), v.as_bytes());
        }
        if f.invalid() {
            return Err(None);
        }
        f.finish().map_err(Some)
    }

    const GET: [(&str, &str); 4] = [
        (":method", "GET"),
        (":scheme", "https"),
        (":authority", "example.com"),
        (":path", "/a?b"),
    ];

    #[test]
    fn a_request_is_read() {
        let mut fields = GET.to_vec();
        fields.push(("accept", "*/*"));
        fields.push(("te", "trailers"));
        let head = read(&fields).unwrap();
        assert_eq!(head.method, Method::GET);
        assert_eq!(head.uri, "https://example.com/a?b");
        assert_eq!(head.headers["accept"], "*/*");
        // Without :authority, the target is the path alone.
        let head = read(&[(":method", "POST"), (":scheme", "http"), (":path", "*")]).unwrap();
        assert_eq!(head.uri, "*");
        let head = read(&[(":method", "CONNECT"), (":authority", "a:443")]).unwrap();
        assert_eq!(head.uri, "a:443");
    }

    #[test]
    fn malformed_requests() {
        let with = |extra: (&'static str, &'static str)| {
            let mut f = GET.to_vec();
            f.push(extra);
            f
        };
        let cases: Vec<Vec<(&str, &str)>> = vec![
            vec![(":scheme", "https"), (":path", "/")],
            vec![(":method", "GET"), (":path", "/")],
            vec![(":method", "GET"), (":scheme", "http")],
            vec![(":method", "GET"), (":scheme", "http"), (":path", "")],
            with((":method", "GET")),
            with((":status", "200")),
            vec![
                ("accept", "x"),
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
            ],
            with(("connection", "close")),
            with(("transfer-encoding", "chunked")),
            with(("te", "gzip")),
            vec![
                (":method", "CONNECT"),
                (":authority", "a:1"),
                (":path", "/"),
            ],
            vec![(":method", "GET"), (":scheme", "http"), (":path", "/ a")],
        ];
        for fields in cases {
            assert!(matches!(read(&fields), Err(Some(_))), "{fields:?}");
        }
        // Fields that are none: the connection ends.
        for bad in [
            ("Accept", "x"),
            ("x", "a\0b"),
            ("x", "a\rb"),
            ("x y", "z"),
            ("", "z"),
            (":bogus", "1"),
        ] {
            assert!(matches!(read(&with(bad)), Err(None)), "{bad:?}");
        }
    }

    #[test]
    fn the_size_limit_counts_every_field() {
        let mut f = Fields::new(100);
        for (n, v) in GET {
            f.field(n.as_bytes(), v.as_bytes());
        }
        assert!(f.too_large());
    }
}
