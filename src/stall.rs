//! Clients that stop reading: cut after `server.client_send_timeout`.
//!
//! A client that accepts no response bytes holds its connection, and the
//! upstream exchange whose answer it does not take. Two watchdogs end that
//! (as nginx's `send_timeout`, which counts between two successive writes):
//!
//! - [`SendTimeout`] wraps a client connection: a write that can make no
//!   progress for the timeout fails, which ends the connection, and with it
//!   the response body and its upstream exchange (an upstream connection
//!   left mid-answer is closed, never pooled). It covers sluice's own
//!   HTTP/1.1 server, hyper's HTTP/1 and an HTTP/2 connection whose socket is
//!   full. The timer is armed only once a write has to wait, so a client
//!   that reads costs nothing.
//! - [`Pumped`] covers an HTTP/2 stream whose client never opens its
//!   flow-control window: the connection's socket is fine, but the HTTP/2
//!   server does not poll the body of a stream without window, so no write
//!   ever waits. A task reads the body ahead of the client into a queue of
//!   up to [`READ_AHEAD`] bytes; when the client has taken nothing from a
//!   full queue for the timeout, the task drops the body (ending the
//!   upstream exchange) and the connection is closed, as a stalled HTTP/1
//!   one is: its other streams' queues, and what the server holds for them,
//!   go with it. What of the body has arrived when the stream is answered
//!   is taken at once, and an answer that has arrived whole (most small
//!   ones) needs no task: it no longer holds the upstream either.

use std::future::Future;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::time::{Instant, Sleep};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a response was cut.
#[derive(Debug, thiserror::Error)]
#[error("the client accepted no response bytes for server.client_send_timeout ({0:?})")]
pub struct Stalled(pub Duration);

/// A limit on how long something may wait without progress: armed when a
/// poll first waits, disarmed by the next one that makes progress, so a
/// peer that keeps up costs no timer at all.
#[derive(Debug)]
pub struct Waiting {
    pub limit: Duration,
    /// Made the first time a poll waits; armed while polls wait.
    timer: Option<Pin<Box<Sleep>>>,
    armed: bool,
}

impl Waiting {
    pub fn new(limit: Duration) -> Waiting {
        Waiting {
            limit,
            timer: None,
            armed: false,
        }
    }

    /// Notes a poll's outcome (`waiting`: it returned `Pending`); ready once
    /// polls have waited for `limit` without progress in between.
    pub fn poll(&mut self, cx: &mut Context<'_>, waiting: bool) -> Poll<()> {
        if !waiting {
            self.armed = false;
            return Poll::Pending;
        }
        let deadline = Instant::now() + self.limit;
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if !self.armed {
            timer.as_mut().reset(deadline);
            self.armed = true;
        }
        timer.as_mut().poll(cx)
    }
}

/// A client connection whose writes fail once they make no progress for
/// `limit` (see the module's doc).
#[derive(Debug)]
pub struct SendTimeout<T> {
    io: T,
    waiting: Waiting,
}

impl<T> SendTimeout<T> {
    pub fn new(io: T, limit: Duration) -> SendTimeout<T> {
        SendTimeout {
            io,
            waiting: Waiting::new(limit),
        }
    }

    pub fn get_mut(&mut self) -> &mut T {
        &mut self.io
    }

    /// What a write that returned `poll` means: progress disarms the timer;
    /// waiting arms it (once) and fails when it fires.
    fn watch<R>(&mut self, cx: &mut Context<'_>, poll: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        match self.waiting.poll(cx, poll.is_pending()) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                Stalled(self.waiting.limit),
            ))),
            Poll::Pending => poll,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for SendTimeout<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for SendTimeout<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.io).poll_write(cx, buf);
        self.watch(cx, poll)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.watch(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.io).poll_flush(cx);
        self.watch(cx, poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Response body bytes read ahead of an HTTP/2 client, at most, by its
/// watchdog (beyond the upstream's `buffer`).
pub const READ_AHEAD: usize = 64 * 1024;

/// What the reading task hands over: a frame and the queue room it takes.
type Item = Result<(Frame<Bytes>, OwnedSemaphorePermit), BoxError>;

/// Frames read before the task started, first first.
type Ready = smallvec::SmallVec<[Result<Frame<Bytes>, BoxError>; 1]>;

/// A response body read by a task of its own (see the module's doc).
pub struct Pumped {
    /// What was read before the task started: all of a small answer that
    /// had already arrived, which then needs no task. Most are one frame,
    /// kept here without an allocation.
    ready: Ready,
    /// The task's queue; `None` when `ready` holds the whole body.
    rx: Option<mpsc::UnboundedReceiver<Item>>,
    hint: SizeHint,
    done: bool,
}

impl Pumped {
    /// Starts reading `body` ahead of the client, at most `room` bytes,
    /// which the client has `limit` to take; `cut` runs if it does not (for
    /// HTTP/2 it closes the connection: the queue, and what the server holds
    /// for the stream, go with it).
    pub fn new<B>(
        body: B,
        room: usize,
        limit: Duration,
        cut: impl FnOnce() + Send + 'static,
    ) -> Pumped
    where
        B: Body<Data = Bytes> + Send + Unpin + 'static,
        B::Error: Into<BoxError> + Send,
    {
        let hint = body.size_hint();
        let mut body = body;
        // What has arrived is taken first: most answers are whole in the
        // upstream read already, and a task per answer is most of what an
        // HTTP/2 stream costs sluice. Nothing is waited for here (a waker
        // that does nothing: the task's real one replaces it).
        let mut ready = Ready::new();
        let mut taken = 0;
        let mut cx = Context::from_waker(std::task::Waker::noop());
        while taken < room {
            match Pin::new(&mut body).poll_frame(&mut cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    taken += frame.data_ref().map_or(0, |d| d.len());
                    ready.push(Ok(frame));
                }
                Poll::Ready(Some(Err(e))) => {
                    ready.push(Err(e.into()));
                    return Pumped::whole(ready, hint);
                }
                Poll::Ready(None) => return Pumped::whole(ready, hint),
                Poll::Pending => break,
            }
        }
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(pump(body, tx, room.max(1), limit, cut));
        Pumped {
            ready,
            rx: Some(rx),
            hint,
            done: false,
        }
    }

    /// A body read to its end before it needed a task.
    fn whole(ready: Ready, hint: SizeHint) -> Pumped {
        Pumped {
            ready,
            rx: None,
            hint,
            done: false,
        }
    }
}

/// Reads `body` into `tx` while the queue has room; ends the body when the
/// client has left (`tx` closed) or taken nothing for `limit`.
async fn pump<B>(
    mut body: B,
    tx: mpsc::UnboundedSender<Item>,
    room: usize,
    limit: Duration,
    cut: impl FnOnce(),
) where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    use http_body_util::BodyExt;
    let room = room.min(Semaphore::MAX_PERMITS).min(u32::MAX as usize);
    let most = room as u32;
    let room = Arc::new(Semaphore::new(room));
    loop {
        let frame = tokio::select! {
            frame = body.frame() => frame,
            // The client is gone: the body is dropped now, not at its end.
            _ = tx.closed() => return,
        };
        let frame = match frame {
            None => return,
            Some(Err(e)) => {
                let _ = tx.send(Err(e.into()));
                return;
            }
            Some(Ok(frame)) => frame,
        };
        // A frame larger than the room waits for all of it.
        let size = frame.data_ref().map_or(0, |d| d.len()).min(most as usize) as u32;
        let permit = match room.clone().try_acquire_many_owned(size) {
            Ok(permit) => permit,
            Err(_) => {
                let waited = tokio::select! {
                    permit = tokio::time::timeout(limit, room.clone().acquire_many_owned(size)) => permit,
                    _ = tx.closed() => return,
                };
                match waited {
                    Ok(Ok(permit)) => permit,
                    // Never closed.
                    Ok(Err(_)) => return,
                    Err(_) => {
                        // The body (and its upstream exchange) ends here.
                        tracing::debug!(limit = ?limit, "cut a client that did not read its response");
                        drop(body);
                        let _ = tx.send(Err(Stalled(limit).into()));
                        cut();
                        return;
                    }
                }
            }
        };
        if tx.send(Ok((frame, permit))).is_err() {
            return;
        }
    }
}

impl Body for Pumped {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.done {
            return Poll::Ready(None);
        }
        if !self.ready.is_empty() {
            let frame = self.ready.remove(0);
            if frame.is_err() {
                self.done = true;
            }
            return Poll::Ready(Some(frame));
        }
        let Some(rx) = &mut self.rx else {
            self.done = true;
            return Poll::Ready(None);
        };
        match rx.poll_recv(cx) {
            Poll::Pending => Poll::Pending,
            // Its permit drops here: the room is the task's again.
            Poll::Ready(Some(Ok((frame, _room)))) => Poll::Ready(Some(Ok(frame))),
            Poll::Ready(Some(Err(e))) => {
                self.done = true;
                Poll::Ready(Some(Err(e)))
            }
            Poll::Ready(None) => {
                self.done = true;
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || (self.rx.is_none() && self.ready.is_empty())
    }

    fn size_hint(&self) -> SizeHint {
        self.hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, StreamBody};

    fn frames(body: &[&str], trailer: Option<&str>) -> Vec<Result<Frame<Bytes>, BoxError>> {
        let mut v: Vec<Result<Frame<Bytes>, BoxError>> = body
            .iter()
            .map(|s| Ok(Frame::data(Bytes::copy_from_slice(s.as_bytes()))))
            .collect();
        if let Some(t) = trailer {
            let mut map = http::HeaderMap::new();
            map.insert("x-tokens", t.parse().unwrap());
            v.push(Ok(Frame::trailers(map)));
        }
        v
    }

    async fn collect(body: Pumped) -> (Vec<u8>, Option<http::HeaderMap>) {
        let all = body.collect().await.unwrap();
        let trailers = all.trailers().cloned();
        (all.to_bytes().to_vec(), trailers)
    }

    #[test]
    fn an_answer_already_arrived_needs_no_task() {
        // No runtime here: spawning the pump would panic.
        let body = StreamBody::new(futures_util::stream::iter(frames(&["o", "k"], Some("7"))));
        let pumped = Pumped::new(body, READ_AHEAD, Duration::from_secs(1), || {});
        assert!(pumped.rx.is_none());
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let (bytes, trailers) = rt.block_on(collect(pumped));
        assert_eq!(bytes, b"ok");
        assert_eq!(trailers.unwrap()["x-tokens"], "7");
    }

    #[tokio::test]
    async fn what_arrived_first_comes_before_what_the_task_reads() {
        let (tx, rx) = mpsc::unbounded_channel::<Result<Frame<Bytes>, BoxError>>();
        for f in frames(&["a", "b"], None) {
            tx.send(f).unwrap();
        }
        let stream = stream_of(rx);
        let pumped = Pumped::new(
            StreamBody::new(stream),
            READ_AHEAD,
            Duration::from_secs(1),
            || {},
        );
        assert!(pumped.rx.is_some(), "the rest is read by the task");
        for f in frames(&["c"], Some("9")) {
            tx.send(f).unwrap();
        }
        drop(tx);
        let (bytes, trailers) = collect(pumped).await;
        assert_eq!(bytes, b"abc");
        assert_eq!(trailers.unwrap()["x-tokens"], "9");
    }

    /// A stream of what `rx` receives.
    fn stream_of<T: Send + 'static>(
        rx: mpsc::UnboundedReceiver<T>,
    ) -> Pin<Box<dyn futures_util::Stream<Item = T> + Send>> {
        Box::pin(futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|t| (t, rx))
        }))
    }
}
