//! Reading an upstream's answer ahead of a slow client, up to the upstream's
//! `buffer`.
//!
//! A backend worker is busy until its answer has been read from it. Read only
//! as fast as the client takes it, a client that reads slowly, or not at all,
//! holds that worker as long as it likes: two such clients held a two-worker
//! backend, and every other client got 504. So an answer that may not fit in
//! the sockets' own buffers is read by a task of its own, up to `buffer` bytes
//! ahead of the client, as nginx's `proxy_buffering` does (in memory here):
//! an answer that fits is read whole, and its connection goes back to the pool
//! whatever the client does. A client that leaves ends the task, and with it
//! the upstream exchange (its connection is closed, not pooled).

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, SizeHint};
use tokio::sync::{Semaphore, mpsc};

use super::pool::PooledBody;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Answers whose whole size is known and at most this are not read ahead:
/// the client's socket buffer takes them at once, so the upstream's
/// connection is free as soon as they are written (and the usual small
/// answer costs no task).
pub const SMALL: u64 = 64 * 1024;

/// The client's end of an answer read ahead.
pub struct Ahead {
    pieces: mpsc::UnboundedReceiver<Piece>,
    /// Bytes that may still be read ahead; the pump takes them, the client's
    /// side gives them back as it takes the frames.
    room: Arc<Semaphore>,
    hint: SizeHint,
    ended: bool,
}

enum Piece {
    /// A frame, and the room it took.
    Frame(Frame<Bytes>, u32),
    Failed(BoxError),
}

/// Whether an answer of this body is worth reading ahead with `buffer` bytes.
pub fn worth_it(body: &PooledBody, buffer: usize) -> bool {
    buffer > 0 && !body.is_end_stream() && body.size_hint().exact().is_none_or(|n| n > SMALL)
}

/// Starts reading `body` ahead of its client, at most `buffer` bytes.
pub fn spawn(body: PooledBody, buffer: usize) -> Ahead {
    // The most one frame can wait for: a frame larger than the room is let
    // through alone once the room is all free.
    let buffer = u32::try_from(buffer).unwrap_or(u32::MAX);
    let room = Arc::new(Semaphore::new(buffer as usize));
    let (tx, pieces) = mpsc::unbounded_channel();
    let hint = body.size_hint();
    tokio::spawn(pump(body, tx, room.clone(), buffer));
    Ahead {
        pieces,
        room,
        hint,
        ended: false,
    }
}

/// Reads `body` into the channel while there is room, until it ends, fails,
/// or the client's side is dropped.
async fn pump(
    mut body: PooledBody,
    tx: mpsc::UnboundedSender<Piece>,
    room: Arc<Semaphore>,
    buffer: u32,
) {
    loop {
        let frame = tokio::select! {
            _ = tx.closed() => return,
            frame = body.frame() => frame,
        };
        let frame = match frame {
            None => return,
            Some(Err(e)) => {
                let _ = tx.send(Piece::Failed(e));
                return;
            }
            Some(Ok(frame)) => frame,
        };
        let size = frame.data_ref().map_or(0, Bytes::len);
        let take = u32::try_from(size).unwrap_or(u32::MAX).min(buffer);
        if take > 0 {
            let permit = tokio::select! {
                _ = tx.closed() => return,
                permit = room.acquire_many(take) => permit,
            };
            match permit {
                Ok(permit) => permit.forget(),
                Err(_) => return,
            }
        }
        if tx.send(Piece::Frame(frame, take)).is_err() {
            return;
        }
    }
}

impl Body for Ahead {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        match self.pieces.poll_recv(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Piece::Frame(frame, took))) => {
                self.room.add_permits(took as usize);
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Piece::Failed(e))) => {
                self.ended = true;
                Poll::Ready(Some(Err(e)))
            }
            Poll::Ready(None) => {
                self.ended = true;
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }

    fn size_hint(&self) -> SizeHint {
        self.hint
    }
}
