//! A request body arriving over HTTP/2: the connection hands over its DATA
//! frames, the proxy reads them, and what it has read is given back to the
//! client as flow-control window (see `conn`). A client can so never have
//! more waiting in sluice than the windows it was given.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use hyper::body::{Body, Frame, SizeHint};

use super::frame::Reason;

/// The body of a request, as the proxy reads it.
pub struct RecvBody {
    /// `None`: the request had no body (END_STREAM on its HEADERS).
    inbox: Option<Arc<Inbox>>,
    /// Its `content-length`, when it sent one.
    length: Option<u64>,
}

/// Why a request body ended before its end: the client reset its stream,
/// or the connection ended.
#[derive(Debug, thiserror::Error)]
#[error("the HTTP/2 request body was cut off (error code {0})")]
pub struct BodyError(pub u32);

/// What the connection and the reader share.
#[derive(Default)]
pub struct Inbox(Mutex<State>);

#[derive(Default)]
struct State {
    data: VecDeque<Bytes>,
    /// Small DATA frames' bytes, gathered: kept one by one, a client's
    /// one-byte frames would each hold a queue entry and the read buffer
    /// they came in.
    small: BytesMut,
    trailers: Option<HeaderMap>,
    /// The client has sent all of it.
    ended: bool,
    /// It will never be whole (a reset, or the connection's end).
    failed: Option<Reason>,
    /// Bytes read and not yet given back as window.
    released: usize,
    /// The reader has gone: what comes is given back at once.
    dropped: bool,
    /// The stream has ended on the connection's side, which has given
    /// back everything: what is read no longer counts.
    detached: bool,
    reader: Option<Waker>,
    /// The connection, to be woken when there is window to give back.
    conn: Option<Waker>,
}

/// Window is given back once this much has been read (a quarter of the
/// stream window: fewer WINDOW_UPDATE frames, and the client never waits).
const RELEASE_AT: usize = super::conn::STREAM_WINDOW as usize / 4;

impl Inbox {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock means a panic elsewhere; the state is whole.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A DATA frame's data. Returns false when the reader has gone (the
    /// data is then the connection's to give back).
    pub fn push(&self, data: Bytes) -> bool {
        let mut s = self.lock();
        if s.dropped {
            return false;
        }
        if data.len() < SMALL {
            s.small.extend_from_slice(&data);
        } else {
            if !s.small.is_empty() {
                let small = s.small.split().freeze();
                s.data.push_back(small);
            }
            s.data.push_back(data);
        }
        wake(s.reader.take());
        true
    }

    /// The client has sent all of it, ending with `trailers`, if any.
    pub fn end(&self, trailers: Option<HeaderMap>) {
        let mut s = self.lock();
        s.ended = true;
        s.trailers = trailers;
        wake(s.reader.take());
    }

    /// Takes the bytes read since the last call (to give back as window);
    /// `waker` is woken when more is read.
    pub fn take_released(&self, waker: &Waker) -> usize {
        let mut s = self.lock();
        if !s.conn.as_ref().is_some_and(|w| w.will_wake(waker)) {
            s.conn = Some(waker.clone());
        }
        std::mem::take(&mut s.released)
    }

    /// The stream is gone from the connection: returns every byte not
    /// given back yet, read or waiting, for the connection's window. With
    /// `failed`, a body the client had not sent whole is cut off (what
    /// waits is dropped, the reader gets an error); otherwise the reader
    /// may still read what is there.
    pub fn detach(&self, failed: Option<Reason>) -> usize {
        let mut s = self.lock();
        let waiting = s.waiting();
        // A body the client sent whole stays whole for its reader.
        if let (Some(reason), false) = (failed, s.ended) {
            s.data.clear();
            s.small.clear();
            s.failed.get_or_insert(reason);
            wake(s.reader.take());
        }
        s.detached = true;
        s.conn = None;
        std::mem::take(&mut s.released) + waiting
    }
}

/// DATA frames shorter than this are gathered (see [`State::small`]).
const SMALL: usize = 1024;

impl State {
    /// Bytes the reader has not taken.
    fn waiting(&self) -> usize {
        self.data.iter().map(Bytes::len).sum::<usize>() + self.small.len()
    }
}

fn wake(w: Option<Waker>) {
    if let Some(w) = w {
        w.wake();
    }
}

impl RecvBody {
    /// A request without a body.
    pub fn empty() -> RecvBody {
        RecvBody {
            inbox: None,
            length: None,
        }
    }

    /// A body the connection fills through `inbox`.
    pub fn new(inbox: Arc<Inbox>, length: Option<u64>) -> RecvBody {
        RecvBody {
            inbox: Some(inbox),
            length,
        }
    }
}

impl Body for RecvBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let Some(inbox) = &self.inbox else {
            return Poll::Ready(None);
        };
        let mut s = inbox.lock();
        let next = match s.data.pop_front() {
            Some(data) => Some(data),
            None if !s.small.is_empty() => Some(s.small.split().freeze()),
            None => None,
        };
        if let Some(data) = next {
            if !s.detached {
                let before = s.released;
                s.released += data.len();
                if before < RELEASE_AT && s.released >= RELEASE_AT {
                    wake(s.conn.take());
                }
            }
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        if let Some(reason) = s.failed {
            return Poll::Ready(Some(Err(BodyError(reason.0))));
        }
        if s.ended {
            return Poll::Ready(s.trailers.take().map(|t| Ok(Frame::trailers(t))));
        }
        if !s.reader.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            s.reader = Some(cx.waker().clone());
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        match &self.inbox {
            None => true,
            Some(inbox) => {
                let s = inbox.lock();
                s.ended && s.waiting() == 0 && s.trailers.is_none()
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match (&self.inbox, self.length) {
            (None, _) => SizeHint::with_exact(0),
            (Some(_), Some(n)) => SizeHint::with_exact(n),
            (Some(_), None) => SizeHint::default(),
        }
    }
}

impl Drop for RecvBody {
    fn drop(&mut self) {
        if let Some(inbox) = &self.inbox {
            let mut s = inbox.lock();
            s.dropped = true;
            // What was waiting is given back too.
            let waiting = s.waiting();
            s.data.clear();
            s.small.clear();
            if !s.detached {
                s.released += waiting;
                wake(s.conn.take());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    /// One-byte DATA frames are gathered: a client cannot make the queue
    /// hold an entry (and a read buffer) per byte.
    #[tokio::test]
    async fn small_frames_are_gathered() {
        let inbox = Arc::new(Inbox::default());
        let body = RecvBody::new(inbox.clone(), Some(6000));
        for _ in 0..4000 {
            assert!(inbox.push(Bytes::from_static(b"x")));
        }
        assert!(inbox.lock().data.is_empty());
        assert!(inbox.push(Bytes::from(vec![b'y'; 2000])));
        assert_eq!(inbox.lock().data.len(), 2);
        inbox.end(None);
        let all = body.collect().await.unwrap().to_bytes();
        assert_eq!(all.len(), 6000);
        assert!(all[..4000].iter().all(|&b| b == b'x'));
    }

    /// What the reader took is given back once; a dropped reader gives
    /// back what waited.
    #[tokio::test]
    async fn read_bytes_are_given_back() {
        let inbox = Arc::new(Inbox::default());
        let mut body = RecvBody::new(inbox.clone(), None);
        inbox.push(Bytes::from(vec![1; 2000]));
        inbox.push(Bytes::from(vec![2; 3000]));
        let first = body.frame().await.unwrap().unwrap();
        assert_eq!(first.into_data().unwrap().len(), 2000);
        let waker = std::task::Waker::noop();
        assert_eq!(inbox.take_released(waker), 2000);
        assert_eq!(inbox.take_released(waker), 0);
        drop(body);
        assert_eq!(inbox.take_released(waker), 3000);
        assert!(!inbox.push(Bytes::from_static(b"late")), "nobody reads");
    }
}
