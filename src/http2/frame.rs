//! HTTP/2 frames (RFC 9113, 4 and 6): a client's frames read from bytes and
//! checked, the server's written.

/// The frame header's size.
pub const HEAD_LEN: usize = 9;

/// The connection preface a client begins with (RFC 9113, 3.4).
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The largest frame payload either side may send until told more
/// (SETTINGS_MAX_FRAME_SIZE's initial value).
pub const DEFAULT_MAX_FRAME: usize = 16_384;

/// Frame types.
pub mod kind {
    pub const DATA: u8 = 0x0;
    pub const HEADERS: u8 = 0x1;
    pub const PRIORITY: u8 = 0x2;
    pub const RST_STREAM: u8 = 0x3;
    pub const SETTINGS: u8 = 0x4;
    pub const PUSH_PROMISE: u8 = 0x5;
    pub const PING: u8 = 0x6;
    pub const GOAWAY: u8 = 0x7;
    pub const WINDOW_UPDATE: u8 = 0x8;
    pub const CONTINUATION: u8 = 0x9;
}

/// Frame flags.
pub mod flag {
    pub const ACK: u8 = 0x1;
    pub const END_STREAM: u8 = 0x1;
    pub const END_HEADERS: u8 = 0x4;
    pub const PADDED: u8 = 0x8;
    pub const PRIORITY: u8 = 0x20;
}

/// Settings identifiers (RFC 9113, 6.5.2).
pub mod setting {
    pub const HEADER_TABLE_SIZE: u16 = 0x1;
    pub const ENABLE_PUSH: u16 = 0x2;
    pub const MAX_CONCURRENT_STREAMS: u16 = 0x3;
    pub const INITIAL_WINDOW_SIZE: u16 = 0x4;
    pub const MAX_FRAME_SIZE: u16 = 0x5;
    pub const MAX_HEADER_LIST_SIZE: u16 = 0x6;
}

/// An error code (RFC 9113, 7), in RST_STREAM and GOAWAY frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reason(pub u32);

impl Reason {
    pub const NO_ERROR: Reason = Reason(0x0);
    pub const PROTOCOL_ERROR: Reason = Reason(0x1);
    pub const INTERNAL_ERROR: Reason = Reason(0x2);
    pub const FLOW_CONTROL_ERROR: Reason = Reason(0x3);
    pub const STREAM_CLOSED: Reason = Reason(0x5);
    pub const FRAME_SIZE_ERROR: Reason = Reason(0x6);
    pub const REFUSED_STREAM: Reason = Reason(0x7);
    pub const CANCEL: Reason = Reason(0x8);
    pub const COMPRESSION_ERROR: Reason = Reason(0x9);
    pub const ENHANCE_YOUR_CALM: Reason = Reason(0xb);
}

/// A frame that breaks the protocol: the connection ends (GOAWAY), or only
/// the stream does (RST_STREAM).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameError {
    Connection(Reason),
    Stream(u32, Reason),
}

/// A frame's header (RFC 9113, 4.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Head {
    pub len: usize,
    pub kind: u8,
    pub flags: u8,
    /// The stream identifier, its reserved bit ignored.
    pub stream: u32,
}

impl Head {
    /// The header at the start of `buf`, if all of it is there.
    pub fn read(buf: &[u8]) -> Option<Head> {
        let h: &[u8; HEAD_LEN] = buf.get(..HEAD_LEN)?.try_into().ok()?;
        Some(Head {
            len: (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]),
            kind: h[3],
            flags: h[4],
            stream: u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff,
        })
    }

    fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }
}

/// A stream's priority (RFC 9113, 5.3.2 and 6.3): read so that it can be
/// checked, then ignored, as RFC 9113 allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Priority {
    pub dependency: u32,
    pub exclusive: bool,
    pub weight: u8,
}

/// A client's frame, its payload checked as far as the frame alone tells.
#[derive(Debug, PartialEq, Eq)]
pub enum Frame<'a> {
    Data {
        stream: u32,
        end_stream: bool,
        data: &'a [u8],
        /// The whole payload, padding too: what flow control counts.
        flow_len: usize,
    },
    Headers {
        stream: u32,
        end_stream: bool,
        end_headers: bool,
        priority: Option<Priority>,
        block: &'a [u8],
    },
    Priority {
        stream: u32,
        priority: Priority,
    },
    RstStream {
        stream: u32,
        reason: Reason,
    },
    Settings(Settings<'a>),
    SettingsAck,
    Ping {
        ack: bool,
        data: [u8; 8],
    },
    GoAway {
        last: u32,
        reason: Reason,
    },
    WindowUpdate {
        stream: u32,
        increment: u32,
    },
    Continuation {
        stream: u32,
        end_headers: bool,
        block: &'a [u8],
    },
    /// A frame type this side does not know: ignored (RFC 9113, 4.1).
    Unknown,
}

/// A SETTINGS frame's parameters, each checked when read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings<'a>(&'a [u8]);

impl Settings<'_> {
    /// The parameters, in order, or the first value that is not allowed.
    /// Unknown identifiers are skipped (RFC 9113, 6.5.2).
    pub fn each(&self) -> impl Iterator<Item = Result<(u16, u32), FrameError>> + '_ {
        self.0.chunks_exact(6).filter_map(|p| {
            let id = u16::from_be_bytes([p[0], p[1]]);
            let value = u32::from_be_bytes([p[2], p[3], p[4], p[5]]);
            let bad = |r| Some(Err(FrameError::Connection(r)));
            match id {
                setting::ENABLE_PUSH if value > 1 => bad(Reason::PROTOCOL_ERROR),
                setting::INITIAL_WINDOW_SIZE if value > MAX_WINDOW => {
                    bad(Reason::FLOW_CONTROL_ERROR)
                }
                setting::MAX_FRAME_SIZE
                    if !(DEFAULT_MAX_FRAME as u32..=MAX_FRAME_LIMIT).contains(&value) =>
                {
                    bad(Reason::PROTOCOL_ERROR)
                }
                setting::HEADER_TABLE_SIZE
                | setting::ENABLE_PUSH
                | setting::MAX_CONCURRENT_STREAMS
                | setting::INITIAL_WINDOW_SIZE
                | setting::MAX_FRAME_SIZE
                | setting::MAX_HEADER_LIST_SIZE => Some(Ok((id, value))),
                _ => None,
            }
        })
    }
}

/// The largest flow-control window (RFC 9113, 6.9.1).
pub const MAX_WINDOW: u32 = (1 << 31) - 1;

/// The largest SETTINGS_MAX_FRAME_SIZE (RFC 9113, 6.5.2).
const MAX_FRAME_LIMIT: u32 = (1 << 24) - 1;

/// Reads the frame `head` introduces from its whole `payload`.
pub fn parse(head: Head, payload: &[u8]) -> Result<Frame<'_>, FrameError> {
    use FrameError::{Connection, Stream};
    let stream = head.stream;
    // Frames of a stream, and frames of the connection (stream 0).
    let on_stream = || {
        if stream == 0 {
            Err(Connection(Reason::PROTOCOL_ERROR))
        } else {
            Ok(())
        }
    };
    let on_connection = || {
        if stream != 0 {
            Err(Connection(Reason::PROTOCOL_ERROR))
        } else {
            Ok(())
        }
    };
    match head.kind {
        kind::DATA => {
            on_stream()?;
            let data = unpad(head, payload)?;
            Ok(Frame::Data {
                stream,
                end_stream: head.has(flag::END_STREAM),
                data,
                flow_len: payload.len(),
            })
        }
        kind::HEADERS => {
            on_stream()?;
            let mut block = unpad(head, payload)?;
            let mut priority = None;
            if head.has(flag::PRIORITY) {
                let (p, rest) = block
                    .split_first_chunk::<5>()
                    .ok_or(Connection(Reason::FRAME_SIZE_ERROR))?;
                let p = read_priority(p);
                if p.dependency == stream {
                    return Err(Stream(stream, Reason::PROTOCOL_ERROR));
                }
                priority = Some(p);
                block = rest;
            }
            Ok(Frame::Headers {
                stream,
                end_stream: head.has(flag::END_STREAM),
                end_headers: head.has(flag::END_HEADERS),
                priority,
                block,
            })
        }
        kind::PRIORITY => {
            on_stream()?;
            let p: &[u8; 5] = payload
                .try_into()
                .map_err(|_| Stream(stream, Reason::FRAME_SIZE_ERROR))?;
            let priority = read_priority(p);
            if priority.dependency == stream {
                return Err(Stream(stream, Reason::PROTOCOL_ERROR));
            }
            Ok(Frame::Priority { stream, priority })
        }
        kind::RST_STREAM => {
            on_stream()?;
            let code = u32_of(payload).ok_or(Connection(Reason::FRAME_SIZE_ERROR))?;
            Ok(Frame::RstStream {
                stream,
                reason: Reason(code),
            })
        }
        kind::SETTINGS => {
            on_connection()?;
            if head.has(flag::ACK) {
                return if payload.is_empty() {
                    Ok(Frame::SettingsAck)
                } else {
                    Err(Connection(Reason::FRAME_SIZE_ERROR))
                };
            }
            if !payload.len().is_multiple_of(6) {
                return Err(Connection(Reason::FRAME_SIZE_ERROR));
            }
            Ok(Frame::Settings(Settings(payload)))
        }
        // A client never promises (RFC 9113, 8.4).
        kind::PUSH_PROMISE => Err(Connection(Reason::PROTOCOL_ERROR)),
        kind::PING => {
            on_connection()?;
            let data: [u8; 8] = payload
                .try_into()
                .map_err(|_| Connection(Reason::FRAME_SIZE_ERROR))?;
            Ok(Frame::Ping {
                ack: head.has(flag::ACK),
                data,
            })
        }
        kind::GOAWAY => {
            on_connection()?;
            if payload.len() < 8 {
                return Err(Connection(Reason::FRAME_SIZE_ERROR));
            }
            let last = u32_of(&payload[..4]).unwrap_or(0) & 0x7fff_ffff;
            let code = u32_of(&payload[4..8]).unwrap_or(0);
            Ok(Frame::GoAway {
                last,
                reason: Reason(code),
            })
        }
        kind::WINDOW_UPDATE => {
            let increment =
                u32_of(payload).ok_or(Connection(Reason::FRAME_SIZE_ERROR))? & 0x7fff_ffff;
            if increment == 0 {
                // A stream error on a stream, says RFC 9113 (6.9); h2 ends
                // the connection, and so does sluice.
                return Err(Connection(Reason::PROTOCOL_ERROR));
            }
            Ok(Frame::WindowUpdate { stream, increment })
        }
        kind::CONTINUATION => {
            on_stream()?;
            Ok(Frame::Continuation {
                stream,
                end_headers: head.has(flag::END_HEADERS),
                block: payload,
            })
        }
        _ => Ok(Frame::Unknown),
    }
}

/// A DATA or HEADERS payload without its padding (RFC 9113, 6.1).
fn unpad(head: Head, payload: &[u8]) -> Result<&[u8], FrameError> {
    if !head.has(flag::PADDED) {
        return Ok(payload);
    }
    let (&pad, rest) = payload
        .split_first()
        .ok_or(FrameError::Connection(Reason::FRAME_SIZE_ERROR))?;
    let pad = usize::from(pad);
    if pad > rest.len() {
        // Padding as long as the payload or longer.
        return Err(FrameError::Connection(Reason::PROTOCOL_ERROR));
    }
    Ok(&rest[..rest.len() - pad])
}

fn read_priority(p: &[u8; 5]) -> Priority {
    let word = u32::from_be_bytes([p[0], p[1], p[2], p[3]]);
    Priority {
        dependency: word & 0x7fff_ffff,
        exclusive: word & 0x8000_0000 != 0,
        weight: p[4],
    }
}

fn u32_of(b: &[u8]) -> Option<u32> {
    let b: [u8; 4] = b.try_into().ok()?;
    Some(u32::from_be_bytes(b))
}

/// Writes a frame header.
pub fn put_head(dst: &mut Vec<u8>, len: usize, kind: u8, flags: u8, stream: u32) {
    let len = (len as u32).to_be_bytes();
    dst.extend_from_slice(&[len[1], len[2], len[3], kind, flags]);
    dst.extend_from_slice(&stream.to_be_bytes());
}

/// Writes a SETTINGS frame of `params`.
pub fn put_settings(dst: &mut Vec<u8>, params: &[(u16, u32)]) {
    put_head(dst, params.len() * 6, kind::SETTINGS, 0, 0);
    for (id, value) in params {
        dst.extend_from_slice(&id.to_be_bytes());
        dst.extend_from_slice(&value.to_be_bytes());
    }
}

pub fn put_settings_ack(dst: &mut Vec<u8>) {
    put_head(dst, 0, kind::SETTINGS, flag::ACK, 0);
}

pub fn put_ping_ack(dst: &mut Vec<u8>, data: [u8; 8]) {
    put_head(dst, 8, kind::PING, flag::ACK, 0);
    dst.extend_from_slice(&data);
}

pub fn put_goaway(dst: &mut Vec<u8>, last: u32, reason: Reason) {
    put_head(dst, 8, kind::GOAWAY, 0, 0);
    dst.extend_from_slice(&last.to_be_bytes());
    dst.extend_from_slice(&reason.0.to_be_bytes());
}

pub fn put_rst_stream(dst: &mut Vec<u8>, stream: u32, reason: Reason) {
    put_head(dst, 4, kind::RST_STREAM, 0, stream);
    dst.extend_from_slice(&reason.0.to_be_bytes());
}

pub fn put_window_update(dst: &mut Vec<u8>, stream: u32, increment: u32) {
    put_head(dst, 4, kind::WINDOW_UPDATE, 0, stream);
    dst.extend_from_slice(&increment.to_be_bytes());
}

/// Writes a header `block` as a HEADERS frame, followed by CONTINUATION
/// frames when it is longer than `max_frame`.
pub fn put_headers(
    dst: &mut Vec<u8>,
    stream: u32,
    block: &[u8],
    end_stream: bool,
    max_frame: usize,
) {
    let mut chunks = block.chunks(max_frame.max(1)).peekable();
    let end = if end_stream { flag::END_STREAM } else { 0 };
    let first = chunks.next().unwrap_or(&[]);
    let last = chunks.peek().is_none();
    put_head(
        dst,
        first.len(),
        kind::HEADERS,
        end | if last { flag::END_HEADERS } else { 0 },
        stream,
    );
    dst.extend_from_slice(first);
    while let Some(chunk) = chunks.next() {
        let last = chunks.peek().is_none();
        let flags = if last { flag::END_HEADERS } else { 0 };
        put_head(dst, chunk.len(), kind::CONTINUATION, flags, stream);
        dst.extend_from_slice(chunk);
    }
}

/// Writes a DATA frame's header; its `len` bytes of data follow.
pub fn put_data_head(dst: &mut Vec<u8>, stream: u32, len: usize, end_stream: bool) {
    let flags = if end_stream { flag::END_STREAM } else { 0 };
    put_head(dst, len, kind::DATA, flags, stream);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = Vec::new();
        put_head(&mut f, payload.len(), kind, flags, stream);
        f.extend_from_slice(payload);
        f
    }

    fn read(bytes: &[u8]) -> Result<Frame<'_>, FrameError> {
        let head = Head::read(bytes).unwrap();
        assert_eq!(head.len, bytes.len() - HEAD_LEN);
        parse(head, &bytes[HEAD_LEN..])
    }

    #[test]
    fn head_round_trips_and_ignores_the_reserved_bit() {
        let mut b = Vec::new();
        put_head(&mut b, 0x12_3456, kind::HEADERS, 0x25, 0x8000_0007);
        let head = Head::read(&b).unwrap();
        assert_eq!(
            head,
            Head {
                len: 0x12_3456,
                kind: kind::HEADERS,
                flags: 0x25,
                stream: 7
            }
        );
        assert_eq!(Head::read(&b[..8]), None);
    }

    #[test]
    fn padding_and_priority_are_taken_off() {
        let f = frame(
            kind::DATA,
            flag::PADDED | flag::END_STREAM,
            1,
            b"\x02abc\0\0",
        );
        assert_eq!(
            read(&f),
            Ok(Frame::Data {
                stream: 1,
                end_stream: true,
                data: b"abc",
                flow_len: 6
            })
        );
        let f = frame(
            kind::HEADERS,
            flag::PADDED | flag::PRIORITY | flag::END_HEADERS,
            3,
            b"\x01\x80\0\0\x01\x10\x82\0",
        );
        assert_eq!(
            read(&f),
            Ok(Frame::Headers {
                stream: 3,
                end_stream: false,
                end_headers: true,
                priority: Some(Priority {
                    dependency: 1,
                    exclusive: true,
                    weight: 16
                }),
                block: b"\x82",
            })
        );
    }

    #[test]
    fn protocol_errors() {
        use FrameError::{Connection, Stream};
        let cases: Vec<(Vec<u8>, FrameError)> = vec![
            (
                frame(kind::DATA, 0, 0, b"x"),
                Connection(Reason::PROTOCOL_ERROR),
            ),
            (
                frame(kind::DATA, flag::PADDED, 1, b"\x01"),
                Connection(Reason::PROTOCOL_ERROR),
            ),
            (
                frame(kind::DATA, flag::PADDED, 1, b""),
                Connection(Reason::FRAME_SIZE_ERROR),
            ),
            (
                frame(kind::HEADERS, flag::PRIORITY, 3, b"\0\0\0\x03\x10"),
                Stream(3, Reason::PROTOCOL_ERROR),
            ),
            (
                frame(kind::PRIORITY, 0, 5, b"\0\0\0\x01"),
                Stream(5, Reason::FRAME_SIZE_ERROR),
            ),
            (
                frame(kind::PRIORITY, 0, 5, b"\0\0\0\x05\x10"),
                Stream(5, Reason::PROTOCOL_ERROR),
            ),
            (
                frame(kind::RST_STREAM, 0, 0, b"\0\0\0\0"),
                Connection(Reason::PROTOCOL_ERROR),
            ),
            (
                frame(kind::RST_STREAM, 0, 1, b"\0\0\0"),
                Connection(Reason::FRAME_SIZE_ERROR),
            ),
            (
                frame(kind::SETTINGS, 0, 1, b""),
                Connection(Reason::PROTOCOL_ERROR),
            ),
            (
                frame(kind::SETTINGS, flag::ACK, 0, b"\0\x01\0\0\0\0"),
                Connection(Reason::FRAME_SIZE_ERROR),
            ),
            (
                frame(kind::SETTINGS, 0, 0, b"\0\x01\0\0\0"),
                Connection(Reason::FRAME_SIZE_ERROR),
            ),
            (
                frame(kind::PUSH_PROMISE, 0, 1, b"\0\0\0\x02"),
                Connection(Reason::PROTOCOL_ERROR),
            ),
            (
                frame(kind::PING, 0, 1, &[0; 8]),
                Connection(Reason::PROTOCOL_ERROR),
            ),
            (
                frame(kind::PING, 0, 0, &[0; 7]),
                Connection(Reason::FRAME_SIZE_ERROR),
            ),
            (
                frame(kind::GOAWAY, 0, 0, &[0; 7]),
                Connection(Reason::FRAME_SIZE_ERROR),
            ),
            (
                frame(kind::WINDOW_UPDATE, 0, 0, &[0; 4]),
                Connection(Reason::PROTOCOL_ERROR),
            ),
            (
                frame(kind::WINDOW_UPDATE, 0, 1, &[0; 4]),
                Connection(Reason::PROTOCOL_ERROR),
            ),
            (
                frame(kind::WINDOW_UPDATE, 0, 1, &[0; 3]),
                Connection(Reason::FRAME_SIZE_ERROR),
            ),
            (
                frame(kind::CONTINUATION, 0, 0, b""),
                Connection(Reason::PROTOCOL_ERROR),
            ),
        ];
        for (bytes, error) in cases {
            assert_eq!(read(&bytes), Err(error), "{bytes:02x?}");
        }
        assert_eq!(read(&frame(0xfa, 0xff, 9, b"anything")), Ok(Frame::Unknown));
    }

    #[test]
    fn settings_are_checked() {
        let mut p = Vec::new();
        for (id, v) in [(1u16, 0u32), (0x99, 7), (4, MAX_WINDOW), (5, 16_384)] {
            p.extend_from_slice(&id.to_be_bytes());
            p.extend_from_slice(&v.to_be_bytes());
        }
        let f = frame(kind::SETTINGS, 0, 0, &p);
        let Ok(Frame::Settings(s)) = read(&f) else {
            panic!("not settings")
        };
        let got: Vec<_> = s.each().collect();
        assert_eq!(got, vec![Ok((1, 0)), Ok((4, MAX_WINDOW)), Ok((5, 16_384))]);
        for (id, v, reason) in [
            (2u16, 2u32, Reason::PROTOCOL_ERROR),
            (4, MAX_WINDOW + 1, Reason::FLOW_CONTROL_ERROR),
            (5, 16_383, Reason::PROTOCOL_ERROR),
            (5, 1 << 24, Reason::PROTOCOL_ERROR),
        ] {
            let mut p = id.to_be_bytes().to_vec();
            p.extend_from_slice(&v.to_be_bytes());
            let f = frame(kind::SETTINGS, 0, 0, &p);
            let Ok(Frame::Settings(s)) = read(&f) else {
                panic!("not settings")
            };
            assert_eq!(s.each().next(), Some(Err(FrameError::Connection(reason))));
        }
    }

    #[test]
    fn long_header_blocks_continue() {
        let block: Vec<u8> = (0..40).collect();
        let mut out = Vec::new();
        put_headers(&mut out, 5, &block, true, 16);
        let first = Head::read(&out).unwrap();
        assert_eq!(
            (first.len, first.kind, first.flags),
            (16, kind::HEADERS, flag::END_STREAM)
        );
        let second = Head::read(&out[25..]).unwrap();
        assert_eq!(
            (second.len, second.kind, second.flags),
            (16, kind::CONTINUATION, 0)
        );
        let third = Head::read(&out[50..]).unwrap();
        assert_eq!(
            (third.len, third.kind, third.flags),
            (8, kind::CONTINUATION, flag::END_HEADERS)
        );
        assert_eq!(out.len(), 3 * HEAD_LEN + 40);
    }
}
