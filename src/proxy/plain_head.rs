//! A quick parser for HTTP/1.1 heads in their usual plain form, with
//! httparse behind it for every other head: the upstream's answers (see
//! `h1::parse_head`) and the client's requests (see `crate::front`).
//!
//! Upstreams nearly always answer `HTTP/1.1 200 OK`, and clients ask
//! `GET /path HTTP/1.1`, then `Name: value` lines, each ended by CRLF, then
//! CRLF. This parser takes that form only, and more strictly than httparse:
//! a method and field names of RFC 9110 token characters; a request target
//! of visible ASCII; values of visible ASCII, spaces and tabs, with no blank
//! at their end; every line ended by CRLF; no folded line. Anything else (a
//! bare LF, a byte above 0x7E, a head not all read yet, too many fields, a
//! version other than HTTP/1.1 or HTTP/1.0) is "not plain", and the caller
//! asks httparse, as it did for every head before. So a head taken here
//! reads the same as httparse reads it (tests compare the two over many
//! heads), and what is not taken stays httparse's to judge.
//!
//! Why: httparse took about 1,400 instructions for nginx's five-field
//! answer and 540 for wrk's one-field request, together 14 % of a proxied
//! `GET` (callgrind). Here values and targets are checked eight bytes at a
//! time, names a byte at a time, and a proxied `GET` takes about 700
//! instructions fewer in all.

use smallvec::SmallVec;

/// An answer head's line as read: by [`parse`], or by httparse (see
/// `h1::parse_head`).
pub struct Head {
    /// Its length, up to and with the blank line.
    pub len: usize,
    pub code: u16,
    /// `HTTP/1.0`, not `HTTP/1.1`.
    pub http10: bool,
}

/// Each field's name and value, in order (the value without blanks around
/// it). Filled in place: returned, it would be copied (half a kilobyte).
pub type ReadFields<'b> = SmallVec<[(&'b [u8], &'b [u8]); 16]>;

/// The head at the front of `buf` if it is whole and plain, with at most
/// `max_fields` fields, which are added to `fields`; otherwise `None`, and
/// `fields` may hold some of them.
pub fn parse<'b>(buf: &'b [u8], max_fields: usize, fields: &mut ReadFields<'b>) -> Option<Head> {
    let line = buf.get(..13)?;
    let http10 = match &line[..9] {
        b"HTTP/1.1 " => false,
        b"HTTP/1.0 " => true,
        _ => return None,
    };
    let digits = &line[9..12];
    if !digits.iter().all(u8::is_ascii_digit) || line[12] != b' ' {
        return None;
    }
    let code = digits
        .iter()
        .fold(0u16, |n, &d| n * 10 + u16::from(d - b'0'));
    // The reason phrase is not used, only checked.
    let at = crlf_after(buf, text_end(buf, 13))?;
    let len = fields_from(buf, at, max_fields, fields)?;
    Some(Head { len, code, http10 })
}

/// A request head's line as read.
pub struct RequestLine<'b> {
    /// The head's length, up to and with the blank line.
    pub len: usize,
    pub method: &'b [u8],
    pub target: &'b [u8],
    /// HTTP/1.0 (else HTTP/1.1).
    pub http10: bool,
}

/// The HTTP/1.1 (or HTTP/1.0) request head at the front of `buf` if it is
/// whole and plain (as an answer's, see the module's doc; its method a
/// token, its target visible ASCII), with at most `max_fields` fields, which
/// are added to `fields`; otherwise `None`, and `fields` may hold some of
/// them.
pub fn parse_request<'b>(
    buf: &'b [u8],
    max_fields: usize,
    fields: &mut ReadFields<'b>,
) -> Option<RequestLine<'b>> {
    let mut at = 0;
    while TOKEN[usize::from(*buf.get(at)?)] {
        at += 1;
    }
    if at == 0 || buf[at] != b' ' {
        return None;
    }
    let from = at + 1;
    let to = visible_end(buf, from);
    let http10 = match buf.get(to..to + 11)? {
        b" HTTP/1.1\r\n" => false,
        b" HTTP/1.0\r\n" => true,
        _ => return None,
    };
    if to == from {
        return None;
    }
    let len = fields_from(buf, to + 11, max_fields, fields)?;
    Some(RequestLine {
        len,
        method: &buf[..at],
        target: &buf[from..to],
        http10,
    })
}

/// The field lines from `at` on, then the blank line: the head's length.
fn fields_from<'b>(
    buf: &'b [u8],
    mut at: usize,
    max_fields: usize,
    fields: &mut ReadFields<'b>,
) -> Option<usize> {
    loop {
        if buf.get(at..at + 2)? == b"\r\n" {
            return Some(at + 2);
        }
        let mut name_end = at;
        while TOKEN[usize::from(*buf.get(name_end)?)] {
            name_end += 1;
        }
        if name_end == at || buf[name_end] != b':' || fields.len() == max_fields {
            return None;
        }
        let mut from = name_end + 1;
        while matches!(buf.get(from), Some(b' ' | b'\t')) {
            from += 1;
        }
        let to = text_end(buf, from);
        if to > from && matches!(buf[to - 1], b' ' | b'\t') {
            return None;
        }
        let next = crlf_after(buf, to)?;
        fields.push((&buf[at..name_end], &buf[from..to]));
        at = next;
    }
}

/// Where the line goes on after the CRLF at `at`, if there is one.
fn crlf_after(buf: &[u8], at: usize) -> Option<usize> {
    (buf.get(at..at + 2)? == b"\r\n").then_some(at + 2)
}

/// The first byte from `at` on that is not text (a tab, or 0x20 to 0x7E),
/// or the end of `buf`.
fn text_end(buf: &[u8], at: usize) -> usize {
    run_end::<0x20, true>(buf, at)
}

/// The first byte from `at` on that is not visible ASCII (0x21 to 0x7E),
/// or the end of `buf`.
fn visible_end(buf: &[u8], at: usize) -> usize {
    run_end::<0x21, false>(buf, at)
}

/// The first byte from `at` on that is below `LOW` (but a tab, if `TAB`) or
/// 0x7F and above, or the end of `buf`: eight bytes at a time.
fn run_end<const LOW: u8, const TAB: bool>(buf: &[u8], mut at: usize) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGHS: u64 = 0x8080_8080_8080_8080;
    let low = ONES * u64::from(LOW);
    while let Some(eight) = buf.get(at..at + 8) {
        let mut word = [0u8; 8];
        word.copy_from_slice(eight);
        let x = u64::from_le_bytes(word);
        // A high bit for each byte below LOW, and for each of 0x7F and
        // above. A borrow or carry only ever marks bytes after a marked
        // one, so the lowest mark is exact.
        let marks = (x.wrapping_sub(low) & !x | x | x.wrapping_add(ONES)) & HIGHS;
        if marks == 0 {
            at += 8;
            continue;
        }
        let first = at + (marks.trailing_zeros() / 8) as usize;
        if !(TAB && buf[first] == b'\t') {
            return first;
        }
        at = first + 1;
    }
    while buf
        .get(at)
        .is_some_and(|&b| (TAB && b == b'\t') || (LOW..0x7F).contains(&b))
    {
        at += 1;
    }
    at
}

/// RFC 9110's token characters: what a field name is made of.
static TOKEN: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        table[b] = c.is_ascii_alphanumeric()
            || matches!(
                c,
                b'!' | b'#'
                    | b'$'
                    | b'%'
                    | b'&'
                    | b'\''
                    | b'*'
                    | b'+'
                    | b'-'
                    | b'.'
                    | b'^'
                    | b'_'
                    | b'`'
                    | b'|'
                    | b'~'
            );
        b += 1;
    }
    table
};

#[cfg(test)]
mod tests {
    use super::*;

    /// A reading of a head: length, code, HTTP/1.0, fields.
    type Reading = Option<(usize, u16, bool, Vec<(Vec<u8>, Vec<u8>)>)>;

    fn httparse_reads(buf: &[u8]) -> Reading {
        let mut slots = [httparse::EMPTY_HEADER; 100];
        let mut resp = httparse::Response::new(&mut slots);
        let len = match resp.parse(buf) {
            Ok(httparse::Status::Complete(len)) => len,
            _ => return None,
        };
        let fields = resp
            .headers
            .iter()
            .map(|h| (h.name.as_bytes().to_vec(), h.value.to_vec()))
            .collect();
        Some((len, resp.code?, resp.version? == 0, fields))
    }

    fn plain_reads(buf: &[u8]) -> Reading {
        let mut fields = ReadFields::new();
        let head = parse(buf, 100, &mut fields)?;
        let fields = fields
            .iter()
            .map(|(n, v)| (n.to_vec(), v.to_vec()))
            .collect();
        Some((head.len, head.code, head.http10, fields))
    }

    /// A reading of a request head: length, method, target, HTTP/1.0 or not,
    /// fields.
    type RequestReading = Option<(usize, Vec<u8>, Vec<u8>, bool, Vec<(Vec<u8>, Vec<u8>)>)>;

    fn httparse_reads_request(buf: &[u8]) -> RequestReading {
        let mut slots = [httparse::EMPTY_HEADER; 100];
        let mut req = httparse::Request::new(&mut slots);
        let len = match req.parse(buf) {
            Ok(httparse::Status::Complete(len)) => len,
            _ => return None,
        };
        let http10 = req.version == Some(0);
        let fields = req
            .headers
            .iter()
            .map(|h| (h.name.as_bytes().to_vec(), h.value.to_vec()))
            .collect();
        let (method, target) = (req.method?.as_bytes(), req.path?.as_bytes());
        Some((len, method.to_vec(), target.to_vec(), http10, fields))
    }

    fn plain_reads_request(buf: &[u8]) -> RequestReading {
        let mut fields = ReadFields::new();
        let line = parse_request(buf, 100, &mut fields)?;
        let fields = fields
            .iter()
            .map(|(n, v)| (n.to_vec(), v.to_vec()))
            .collect();
        Some((
            line.len,
            line.method.to_vec(),
            line.target.to_vec(),
            line.http10,
            fields,
        ))
    }

    const WRK: &[u8] = b"GET / HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n\r\n";

    #[test]
    fn usual_requests_are_plain_and_read_as_httparse_reads_them() {
        let heads: &[&[u8]] = &[
            WRK,
            b"POST /a/b?c=d&e=%20f#x HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\nAccept: */*\r\n\r\n",
            b"GET http://a.example/x HTTP/1.1\r\n\r\n",
            b"M-SEARCH * HTTP/1.1\r\nX:\r\n\r\nnext",
            b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
        ];
        for &head in heads {
            let plain = plain_reads_request(head);
            assert!(plain.is_some(), "{:?}", String::from_utf8_lossy(head));
            let httparse = httparse_reads_request(head);
            assert_eq!(plain, httparse, "{:?}", String::from_utf8_lossy(head));
        }
        let others: &[&[u8]] = &[
            b"GET / HTTP/1.2\r\n\r\n",
            b"GET /caf\xc3\xa9 HTTP/1.1\r\n\r\n",
            b"GET  / HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1\n\n",
            b"GET / HTTP/1.1\r\nHost: a\r\n",
            b"\r\nGET / HTTP/1.1\r\n\r\n",
            b"G(T / HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1 \r\n\r\n",
        ];
        for &head in others {
            let plain = parse_request(head, 100, &mut ReadFields::new()).is_some();
            assert!(!plain, "{:?}", String::from_utf8_lossy(head));
        }
    }

    const NGINX: &[u8] =
        b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Mon, 23 Nov 2026 10:00:00 GMT\r\n\
        Content-Type: text/plain\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok";

    #[test]
    fn usual_heads_are_plain_and_read_as_httparse_reads_them() {
        let heads: &[&[u8]] = &[
            NGINX,
            b"HTTP/1.1 204 No Content\r\n\r\n",
            b"HTTP/1.0 200 \r\nX-Empty:\r\nX-Blank: \t \r\nX-Tab: a\tb\r\n\r\n",
            b"HTTP/1.1 404 Not Found\r\nx:y\r\nA-Very-Long-Field-Name-Indeed: a value that is longer than eight bytes, several times over\r\n\r\n",
            b"HTTP/1.1 999 Whatever It Says !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~\r\nk: v\r\n\r\n",
        ];
        for &head in heads {
            let plain = plain_reads(head);
            assert!(plain.is_some(), "{:?}", String::from_utf8_lossy(head));
            assert_eq!(
                plain,
                httparse_reads(head),
                "{:?}",
                String::from_utf8_lossy(head)
            );
        }
        let mut fields = ReadFields::new();
        let head = parse(NGINX, 100, &mut fields).unwrap();
        assert_eq!((head.code, head.http10, fields.len()), (200, false, 5));
        assert_eq!(&NGINX[head.len..], b"ok");
    }

    #[test]
    fn other_heads_are_left_to_httparse() {
        let heads: &[&[u8]] = &[
            b"HTTP/1.1 200 OK\nX: 1\n\n",
            b"HTTP/1.1 200 OK\r\nX: 1\n\r\n",
            b"HTTP/1.1 200 OK\r\nX: 1 \r\n\r\n",
            b"HTTP/1.1 200 OK\r\nX: caf\xc3\xa9\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nX: a\x7fb\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nX: a\x00b\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nX: 1\r\n folded\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nX : 1\r\n\r\n",
            b"HTTP/1.1 200 OK\r\n: 1\r\n\r\n",
            b"HTTP/1.1 200\r\n\r\n",
            b"HTTP/1.1 20 OK\r\n\r\n",
            b"HTTP/2.0 200 OK\r\n\r\n",
            b"\r\nHTTP/1.1 200 OK\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nX: 1\r\n",
            b"HTTP/1.1 200 OK\r\nX: 1\r",
            b"HTTP/1.1 200 OK\r\nX: 1",
            b"HTTP/1.1 200 O",
        ];
        for &head in heads {
            let plain = parse(head, 100, &mut ReadFields::new()).is_some();
            assert!(!plain, "{:?}", String::from_utf8_lossy(head));
        }
        // More fields than asked for.
        assert!(parse(NGINX, 4, &mut ReadFields::new()).is_none());
        assert!(parse(NGINX, 5, &mut ReadFields::new()).is_some());
    }

    /// Heads made by changing, adding or taking out bytes of `seeds`, 30,000
    /// of them: each one `plain` takes, `httparse` reads the same way; and
    /// enough of both kinds come up to mean something.
    fn compare_changed_heads<T: PartialEq + std::fmt::Debug>(
        seeds: &[&[u8]],
        plain: fn(&[u8]) -> Option<T>,
        httparse: fn(&[u8]) -> Option<T>,
    ) {
        // Bytes that matter to either parser.
        let bytes = b"\r\n\t :Aa0~\x7f\x80\xff\x00\"(";
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let mut random = |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        let (mut taken, total) = (0, 30_000);
        for _ in 0..total {
            let mut head = seeds[random(seeds.len())].to_vec();
            for _ in 0..1 + random(3) {
                let at = random(head.len());
                let b = bytes[random(bytes.len())];
                match random(3) {
                    0 => head[at] = b,
                    1 => head.insert(at, b),
                    _ => {
                        head.remove(at);
                    }
                }
            }
            if let Some(read) = plain(&head) {
                taken += 1;
                assert_eq!(
                    Some(read),
                    httparse(&head),
                    "{:?}",
                    String::from_utf8_lossy(&head)
                );
            }
        }
        assert!(
            taken > total / 10 && taken < total * 9 / 10,
            "{taken} of {total}"
        );
    }

    #[test]
    fn a_head_taken_here_reads_as_httparse_reads_it_whatever_its_bytes() {
        let answers: &[&[u8]] = &[
            NGINX,
            b"HTTP/1.0 302 Found\r\nLocation: /x\r\nX:\r\nX-T: a\tb\r\n\r\n",
        ];
        compare_changed_heads(answers, plain_reads, httparse_reads);
        let requests: &[&[u8]] = &[
            WRK,
            b"POST /a?b=%20 HTTP/1.1\r\nHost: a\r\nX-T: a\tb\r\nX:\r\n\r\n",
        ];
        compare_changed_heads(requests, plain_reads_request, httparse_reads_request);
    }
}
