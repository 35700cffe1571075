//! A request's fields as the phases read them: from hyper's header map, or
//! where sluice's own HTTP/1.1 front read them in the head.
//!
//! The front makes no header map: for wrk's one-field request, making,
//! hashing into, looking up in and dropping one cost about 1,000
//! instructions, and each further field about 700 (a name lookup, a value
//! check, a hash, a slice of the head and its drop). Its fields stay spans
//! of the head, found by a scan: a request has few, and the phases look up
//! two or three names.

use std::ops::Range;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use smallvec::SmallVec;

use crate::ascii::eq_lower;

/// The fields of one request, wherever they were read.
#[derive(Clone, Copy)]
pub enum Fields<'a> {
    /// A header map: hyper's reading (HTTP/1.0, unusual heads), the own
    /// HTTP/2 server's, or a test's.
    Map(&'a HeaderMap),
    /// The front's reading: spans of the head.
    Head(&'a HeadFields),
}

impl<'a> Fields<'a> {
    /// The values of the fields named `name`, in order.
    pub fn values(self, name: &'a HeaderName) -> Values<'a> {
        match self {
            Fields::Map(map) => Values::Map(map.get_all(name).iter()),
            Fields::Head(head) => Values::Head {
                spans: head.spans.iter(),
                head: &head.head,
                name: name.as_str().as_bytes(),
            },
        }
    }

    /// Every field, name and value, in order; names of a map in lowercase,
    /// those of a head as the client wrote them.
    pub fn iter(self) -> Iter<'a> {
        match self {
            Fields::Map(map) => Iter::Map(map.iter()),
            Fields::Head(head) => Iter::Head {
                spans: head.spans.iter(),
                head: &head.head,
            },
        }
    }
}

/// See [`Fields::values`].
pub enum Values<'a> {
    Map(header::ValueIter<'a, HeaderValue>),
    Head {
        spans: std::slice::Iter<'a, Span>,
        head: &'a [u8],
        name: &'a [u8],
    },
}

impl<'a> Iterator for Values<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        match self {
            Values::Map(values) => values.next().map(HeaderValue::as_bytes),
            Values::Head { spans, head, name } => spans
                .find(|s| eq_lower(&head[s.name()], name))
                .map(|s| &head[s.value()]),
        }
    }
}

/// See [`Fields::iter`].
pub enum Iter<'a> {
    Map(header::Iter<'a, HeaderValue>),
    Head {
        spans: std::slice::Iter<'a, Span>,
        head: &'a [u8],
    },
}

impl<'a> Iterator for Iter<'a> {
    type Item = (&'a [u8], &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        match self {
            Iter::Map(fields) => fields
                .next()
                .map(|(n, v)| (n.as_str().as_bytes(), v.as_bytes())),
            Iter::Head { spans, head } => spans.next().map(|s| (&head[s.name()], &head[s.value()])),
        }
    }
}

/// A value as text, as `HeaderValue::to_str` gives it: `None` unless every
/// byte is visible ASCII, a space or a tab.
pub fn text(value: &[u8]) -> Option<&str> {
    if value
        .iter()
        .all(|&b| b == b'\t' || (0x20..0x7f).contains(&b))
    {
        std::str::from_utf8(value).ok()
    } else {
        None
    }
}

/// A request head as the front read it, and where each field lies in it.
/// Its names are tokens and its values bytes a `HeaderValue` takes (the
/// parsers that read it check both).
#[derive(Default)]
pub struct HeadFields {
    head: Bytes,
    spans: SmallVec<[Span; 16]>,
}

/// Where one field's name and value lie in the head (a head is far below
/// 4 GiB).
#[derive(Clone, Copy)]
pub struct Span([u32; 4]);

impl Span {
    fn name(&self) -> Range<usize> {
        self.0[0] as usize..self.0[1] as usize
    }

    fn value(&self) -> Range<usize> {
        self.0[2] as usize..self.0[3] as usize
    }
}

impl HeadFields {
    /// The head the noted fields lie in.
    pub fn set_head(&mut self, head: Bytes) {
        self.head = head;
    }

    /// Notes a field: its name and value as ranges of the head.
    pub fn push(&mut self, name: Range<usize>, value: Range<usize>) {
        let at = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        self.spans.push(Span([
            at(name.start),
            at(name.end),
            at(value.start),
            at(value.end),
        ]));
    }

    /// Forgets the fields and lets go of the head (the read buffer it
    /// shares), keeping the room.
    pub fn clear(&mut self) {
        self.head = Bytes::new();
        self.spans.clear();
    }

    /// Forgets the fields whose names `drop` picks (names as read, in any
    /// case): they are not read or forwarded after this.
    pub fn remove_names(&mut self, drop: impl Fn(&[u8]) -> bool) {
        let head = &self.head;
        self.spans.retain(|s| !drop(&head[s.name()]));
    }

    /// The head's bytes.
    pub fn head(&self) -> &Bytes {
        &self.head
    }

    /// `value`, one of this head's values (from [`Fields::values`] or
    /// [`Fields::iter`]), as a share of the head rather than a copy.
    pub fn share(&self, value: &[u8]) -> Bytes {
        self.head.slice_ref(value)
    }

    /// The fields as a header map, for hyper's client (an `https` upstream).
    /// `None` if a name or value is not one a map takes (the front's parsers
    /// never let such a head through).
    pub fn to_map(&self) -> Option<HeaderMap> {
        let mut map = HeaderMap::with_capacity(self.spans.len() + 3);
        for s in &self.spans {
            let name = HeaderName::from_bytes(&self.head[s.name()]).ok()?;
            let value = HeaderValue::from_maybe_shared(self.head.slice(s.value())).ok()?;
            map.append(name, value);
        }
        Some(map)
    }
}

#[cfg(test)]
impl HeadFields {
    /// A head of `fields` (after a request line), as the front notes it.
    pub(crate) fn of_lines(fields: &[(&str, &str)]) -> HeadFields {
        let mut text = String::from("GET / HTTP/1.1\r\n");
        let mut head = HeadFields::default();
        for (name, value) in fields {
            let at = text.len();
            text.push_str(&format!("{name}: {value}\r\n"));
            let value_at = at + name.len() + 2;
            head.push(at..at + name.len(), value_at..value_at + value.len());
        }
        text.push_str("\r\n");
        head.set_head(Bytes::from(text));
        head
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_head_and_a_map_read_the_same() {
        let head = HeadFields::of_lines(&[
            ("Host", "a"),
            ("X-Key", "1"),
            ("x-key", "2"),
            ("Accept", "*/*"),
        ]);
        let map = head.to_map().expect("a valid head");
        static KEY: HeaderName = HeaderName::from_static("x-key");
        for fields in [Fields::Head(&head), Fields::Map(&map)] {
            let values: Vec<&[u8]> = fields.values(&KEY).collect();
            assert_eq!(values, [b"1".as_slice(), b"2"]);
            assert_eq!(fields.values(&header::HOST).collect::<Vec<_>>(), [b"a"]);
            assert_eq!(fields.values(&header::COOKIE).count(), 0);
            let names: Vec<Vec<u8>> = fields.iter().map(|(n, _)| n.to_ascii_lowercase()).collect();
            assert_eq!(names, [&b"host"[..], b"x-key", b"x-key", b"accept"]);
        }
    }
}
