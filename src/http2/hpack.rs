//! HPACK (RFC 7541): request header blocks decoded into fields, response
//! fields encoded.
//!
//! The decoder keeps the dynamic table the client's encoder fills. The
//! encoder never fills one: every field it writes is a literal (its name
//! indexed when the static table has it), so a response costs no table
//! lookups, and the client's table stays empty.

use std::collections::VecDeque;

use super::huffman;

/// The static table (RFC 7541, Appendix A), index 1 first.
pub const STATIC: [(&str, &str); 61] = [
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
];

/// A header block that is not valid HPACK: a connection error of type
/// COMPRESSION_ERROR (RFC 9113, 4.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("HPACK: the block ends inside a field")]
    Truncated,
    #[error("HPACK: an integer longer than 5 bytes")]
    Integer,
    #[error("HPACK: index {0} is in neither table")]
    Index(usize),
    #[error("HPACK: a string's Huffman code is invalid")]
    Huffman,
    #[error("HPACK: table size {0} is above the {1} allowed")]
    TableSize(usize, usize),
    #[error("HPACK: a table size update after a field")]
    LateSizeUpdate,
}

/// The client encoder's dynamic table, as the decoder sees it.
struct Table {
    /// Newest first: index 62 is `entries[0]`.
    entries: VecDeque<Entry>,
    /// The sum of the entries' sizes (RFC 7541, 4.1).
    size: usize,
    /// The size the client's encoder last set.
    max: usize,
}

/// A field in the dynamic table: its name then its value, in one box.
struct Entry {
    bytes: Box<[u8]>,
    name_len: usize,
}

impl Entry {
    fn name(&self) -> &[u8] {
        &self.bytes[..self.name_len]
    }

    fn value(&self) -> &[u8] {
        &self.bytes[self.name_len..]
    }

    /// RFC 7541, 4.1: the name's and value's lengths, plus 32.
    fn size(&self) -> usize {
        self.bytes.len() + 32
    }
}

impl Table {
    fn evict_to(&mut self, max: usize) {
        while self.size > max {
            match self.entries.pop_back() {
                Some(e) => self.size -= e.size(),
                None => break,
            }
        }
    }

    /// Adds `entry`; one larger than the whole table empties it and is
    /// not kept (RFC 7541, 4.4).
    fn insert(&mut self, entry: Entry) {
        let size = entry.size();
        if size > self.max {
            self.entries.clear();
            self.size = 0;
            return;
        }
        self.evict_to(self.max - size);
        self.size += size;
        self.entries.push_front(entry);
    }

    /// Field `index` of both tables (1-based, the static table first).
    fn get(&self, index: usize) -> Result<(&[u8], &[u8]), DecodeError> {
        if index == 0 {
            return Err(DecodeError::Index(0));
        }
        if let Some((name, value)) = STATIC.get(index - 1) {
            return Ok((name.as_bytes(), value.as_bytes()));
        }
        self.entries
            .get(index - 1 - STATIC.len())
            .map(|e| (e.name(), e.value()))
            .ok_or(DecodeError::Index(index))
    }
}

/// Decodes a connection's header blocks, in the order they came.
pub struct Decoder {
    table: Table,
    /// The largest table the client may ask for: the
    /// SETTINGS_HEADER_TABLE_SIZE sluice announces.
    limit: usize,
    /// Huffman-decoded strings, kept for the next.
    name_buf: Vec<u8>,
    value_buf: Vec<u8>,
}

/// Where a string of a field is: in the block, or decoded into a buffer.
#[derive(Clone, Copy)]
enum Str {
    Raw(usize, usize),
    Decoded,
}

impl Decoder {
    /// A decoder whose client may use a table of `limit` bytes (4,096
    /// unless sluice announces otherwise).
    pub fn new(limit: usize) -> Decoder {
        Decoder {
            table: Table {
                entries: VecDeque::new(),
                size: 0,
                max: limit,
            },
            limit,
            name_buf: Vec::new(),
            value_buf: Vec::new(),
        }
    }

    /// Decodes the whole header `block`, handing each field's name and
    /// value to `field`, in order. The block is decoded to its end even
    /// when the caller wants no more of it: the table must stay as the
    /// client's encoder has it.
    pub fn decode(
        &mut self,
        block: &[u8],
        mut field: impl FnMut(&[u8], &[u8]),
    ) -> Result<(), DecodeError> {
        let mut at = 0;
        let mut fields = false;
        while at < block.len() {
            let first = block[at];
            if first & 0x80 != 0 {
                // Indexed field (6.1).
                let index = int(block, &mut at, 7)?;
                let (name, value) = self.table.get(index)?;
                field(name, value);
                fields = true;
            } else if first & 0xe0 == 0x20 {
                // Dynamic table size update (6.3): only before the fields.
                if fields {
                    return Err(DecodeError::LateSizeUpdate);
                }
                let max = int(block, &mut at, 5)?;
                if max > self.limit {
                    return Err(DecodeError::TableSize(max, self.limit));
                }
                self.table.max = max;
                self.table.evict_to(max);
            } else {
                // A literal (6.2): with incremental indexing (01), without
                // (0000), or never indexed (0001).
                let indexing = first & 0xc0 == 0x40;
                let prefix = if indexing { 6 } else { 4 };
                let index = int(block, &mut at, prefix)?;
                let name = if index == 0 {
                    Some(string(block, &mut at, &mut self.name_buf)?)
                } else {
                    // Checked now: the name's index must exist.
                    self.table.get(index)?;
                    None
                };
                let value = string(block, &mut at, &mut self.value_buf)?;
                let value = match value {
                    Str::Raw(from, to) => &block[from..to],
                    Str::Decoded => &self.value_buf[..],
                };
                let name = match name {
                    Some(Str::Raw(from, to)) => &block[from..to],
                    Some(Str::Decoded) => &self.name_buf[..],
                    None => self.table.get(index)?.0,
                };
                if indexing {
                    let mut bytes = Vec::with_capacity(name.len() + value.len());
                    bytes.extend_from_slice(name);
                    bytes.extend_from_slice(value);
                    let entry = Entry {
                        bytes: bytes.into_boxed_slice(),
                        name_len: name.len(),
                    };
                    field(entry.name(), entry.value());
                    self.table.insert(entry);
                } else {
                    field(name, value);
                }
                fields = true;
            }
        }
        Ok(())
    }
}

/// Reads an integer with an `n`-bit prefix at `block[*at]` (RFC 7541, 5.1).
/// At most 5 bytes follow the prefix, so the value fits in 32 bits.
fn int(block: &[u8], at: &mut usize, n: u32) -> Result<usize, DecodeError> {
    let mask = (1usize << n) - 1;
    let first = *block.get(*at).ok_or(DecodeError::Truncated)? as usize & mask;
    *at += 1;
    if first < mask {
        return Ok(first);
    }
    let mut value = mask;
    for shift in (0..5).map(|i| i * 7) {
        let b = *block.get(*at).ok_or(DecodeError::Truncated)?;
        *at += 1;
        value += (b as usize & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err(DecodeError::Integer)
}

/// Reads a string literal at `block[*at]` (RFC 7541, 5.2): where it is in
/// the block, or, Huffman-coded, decoded into `buf`.
fn string(block: &[u8], at: &mut usize, buf: &mut Vec<u8>) -> Result<Str, DecodeError> {
    let huffman = block.get(*at).ok_or(DecodeError::Truncated)? & 0x80 != 0;
    let len = int(block, at, 7)?;
    let from = *at;
    let to = from
        .checked_add(len)
        .filter(|&to| to <= block.len())
        .ok_or(DecodeError::Truncated)?;
    *at = to;
    if !huffman {
        return Ok(Str::Raw(from, to));
    }
    buf.clear();
    huffman::decode(&block[from..to], buf).map_err(|_| DecodeError::Huffman)?;
    Ok(Str::Decoded)
}

/// Encodes response header blocks (see the module's doc).
pub struct Encoder {
    /// The client has set a table size since the last block: the next one
    /// begins by setting the table to 0 (RFC 7541, 4.2), which any size
    /// allows. So does the first, for clients that expect to be told.
    size_update: bool,
}

impl Default for Encoder {
    fn default() -> Encoder {
        Encoder { size_update: true }
    }
}

impl Encoder {
    /// The client's SETTINGS_HEADER_TABLE_SIZE arrived.
    pub fn table_size_set(&mut self) {
        self.size_update = true;
    }

    /// Begins a header block in `dst` with `:status`.
    pub fn status(&mut self, status: u16, dst: &mut Vec<u8>) {
        if std::mem::take(&mut self.size_update) {
            dst.push(0x20);
        }
        let index = match status {
            200 => 8,
            204 => 9,
            206 => 10,
            304 => 11,
            400 => 12,
            404 => 13,
            500 => 14,
            _ => 0,
        };
        if index != 0 {
            dst.push(0x80 | index);
            return;
        }
        // Literal without indexing, name ":status" (index 8).
        dst.push(0x08);
        let mut digits = itoa::Buffer::new();
        let digits = digits.format(status);
        put_int(dst, 0x00, 7, digits.len());
        dst.extend_from_slice(digits.as_bytes());
    }

    /// Adds every field of `fields` (see [`Encoder::field`]).
    pub fn fields(&mut self, fields: &http::HeaderMap, dst: &mut Vec<u8>) {
        for (name, value) in fields {
            self.field(name.as_str().as_bytes(), value.as_bytes(), dst);
        }
    }

    /// Adds a field: a literal without indexing, its name indexed when the
    /// static table has it. Begins a block (a trailers block) if `status`
    /// has not.
    pub fn field(&mut self, name: &[u8], value: &[u8], dst: &mut Vec<u8>) {
        if std::mem::take(&mut self.size_update) {
            dst.push(0x20);
        }
        match static_name(name) {
            Some(index) => put_int(dst, 0x00, 4, index),
            None => {
                dst.push(0x00);
                put_int(dst, 0x00, 7, name.len());
                dst.extend_from_slice(name);
            }
        }
        put_int(dst, 0x00, 7, value.len());
        dst.extend_from_slice(value);
    }
}

/// Writes `value` as an integer with an `n`-bit prefix, the first byte's
/// other bits `flags` (RFC 7541, 5.1).
pub fn put_int(dst: &mut Vec<u8>, flags: u8, n: u32, value: usize) {
    let mask = (1usize << n) - 1;
    if value < mask {
        dst.push(flags | value as u8);
        return;
    }
    dst.push(flags | mask as u8);
    let mut rest = value - mask;
    while rest >= 0x80 {
        dst.push(0x80 | (rest & 0x7f) as u8);
        rest >>= 7;
    }
    dst.push(rest as u8);
}

/// The static table's index of `name`, for the names responses carry.
fn static_name(name: &[u8]) -> Option<usize> {
    // Only the first entry of each name is wanted; pseudo-headers never
    // reach here.
    STATIC
        .iter()
        .position(|(n, _)| n.as_bytes() == name)
        .map(|i| i + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_all(d: &mut Decoder, block: &[u8]) -> Result<Vec<(String, String)>, DecodeError> {
        let mut out = Vec::new();
        d.decode(block, |n, v| {
            out.push((
                String::from_utf8_lossy(n).into_owned(),
                String::from_utf8_lossy(v).into_owned(),
            ))
        })?;
        Ok(out)
    }

    fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
        p.iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect()
    }

    /// RFC 7541, C.4: three requests with Huffman coding, one table.
    #[test]
    fn rfc_c4_requests() {
        let mut d = Decoder::new(4096);
        let first = hex("828684418cf1e3c2e5f23a6ba0ab90f4ff");
        assert_eq!(
            decode_all(&mut d, &first).unwrap(),
            pairs(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com")
            ])
        );
        let second = hex("828684be5886a8eb10649cbf");
        assert_eq!(
            decode_all(&mut d, &second).unwrap(),
            pairs(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com"),
                ("cache-control", "no-cache")
            ])
        );
        let third = hex("828785bf408825a849e95ba97d7f8925a849e95bb8e8b4bf");
        assert_eq!(
            decode_all(&mut d, &third).unwrap(),
            pairs(&[
                (":method", "GET"),
                (":scheme", "https"),
                (":path", "/index.html"),
                (":authority", "www.example.com"),
                ("custom-key", "custom-value")
            ])
        );
        assert_eq!(d.table.size, 164);
    }

    /// RFC 7541, C.5: responses with a 256-byte table, entries evicted.
    #[test]
    fn rfc_c5_eviction() {
        let mut d = Decoder::new(256);
        d.table.max = 256;
        let blocks = [
            "4803333032580770726976617465611d4d6f6e2c203231204f637420323031332032303a31333a323120474d546e1768747470733a2f2f7777772e6578616d706c652e636f6d",
            "4803333037c1c0bf",
        ];
        decode_all(&mut d, &hex(blocks[0])).unwrap();
        assert_eq!(d.table.size, 222);
        let second = decode_all(&mut d, &hex(blocks[1])).unwrap();
        assert_eq!(second[0], (":status".into(), "307".into()));
        assert_eq!(
            second[3],
            ("location".into(), "https://www.example.com".into())
        );
        assert_eq!(d.table.size, 222);
        assert_eq!(d.table.entries.len(), 4);
    }

    #[test]
    fn bad_blocks_are_errors() {
        let cases: [(&str, DecodeError); 7] = [
            ("80", DecodeError::Index(0)),
            ("be", DecodeError::Index(62)),
            ("40", DecodeError::Truncated),
            ("410f7777", DecodeError::Truncated),
            ("ffffffffffff7f", DecodeError::Integer),
            ("3fe21f", DecodeError::TableSize(4097, 4096)),
            ("8220", DecodeError::LateSizeUpdate),
        ];
        for (block, error) in cases {
            let block = hex(block);
            let mut d = Decoder::new(4096);
            assert_eq!(decode_all(&mut d, &block), Err(error), "{block:02x?}");
        }
    }

    #[test]
    fn encoded_fields_decode() {
        let mut e = Encoder::default();
        let mut block = Vec::new();
        e.status(200, &mut block);
        e.field(b"content-type", b"text/plain", &mut block);
        e.field(b"x-long", &[b'a'; 300], &mut block);
        let mut again = Vec::new();
        e.status(418, &mut again);
        let mut d = Decoder::new(4096);
        let got = decode_all(&mut d, &block).unwrap();
        assert_eq!(got[0], (":status".into(), "200".into()));
        assert_eq!(got[1], ("content-type".into(), "text/plain".into()));
        assert_eq!(got[2].1.len(), 300);
        assert_eq!(
            decode_all(&mut d, &again).unwrap(),
            pairs(&[(":status", "418")])
        );
        assert_eq!(d.table.size, 0, "the encoder never fills the table");
    }

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }
}
