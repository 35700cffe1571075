//! What a keep-alive request, and an HTTP/2 stream, cost sluice's thread in
//! heap allocations, counted by this binary's allocator. sluice, its
//! upstream and the client each run on a thread of their own, so that only
//! sluice's are counted.
//!
//! An allocation a request is a cost the bench would show only once several
//! had crept in; this holds their number (see docs/performance.md, "What
//! was tried and ruled out", for one that was measured).

mod support;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::thread::LocalKey;

use http::Request;
use support::*;
use tokio::io::AsyncWriteExt;

struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
    /// Of them, those of 8 KB or more: a read buffer's size.
    static LARGE: Cell<u64> = const { Cell::new(0) };
}

fn count(size: usize) {
    let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
    if size >= 8 * 1024 {
        let _ = LARGE.try_with(|n| n.set(n.get() + 1));
    }
}

// SAFETY: every call is passed to the system allocator as it came; the
// counters are const-initialised thread-locals without a destructor, so
// counting never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// A runtime on a thread of its own, running `start`'s future; its handle
/// runs tasks on that thread. What the future made besides `T` is kept there.
fn on_own_thread<T, K, F>(start: impl FnOnce() -> F + Send + 'static) -> (tokio::runtime::Handle, T)
where
    T: Send + 'static,
    F: std::future::Future<Output = (T, K)>,
{
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let (out, _kept) = start().await;
            tx.send((tokio::runtime::Handle::current(), out)).unwrap();
            std::future::pending::<()>().await
        })
    });
    rx.recv().unwrap()
}

/// An upstream as nginx answers: every request read gets the same short
/// answer, on keep-alive connections.
async fn nginx_like() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                while read_request_head(&mut conn).await {
                    let answer = b"HTTP/1.1 200 OK\r\nServer: nginx\r\n\
                        Date: Thu, 26 Nov 2026 04:00:00 GMT\r\n\
                        Content-Type: text/plain\r\nContent-Length: 2\r\n\
                        Connection: keep-alive\r\n\r\nok";
                    if conn.write_all(answer).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    url
}

/// sluice on a thread of its own, in front of an nginx-like upstream on
/// another: its runtime's handle and its address.
fn sluice_on_own_thread() -> (tokio::runtime::Handle, std::net::SocketAddr) {
    let (_, upstream) = on_own_thread(|| async { (nginx_like().await, ()) });
    on_own_thread(move || async move {
        let sluice = Sluice::start(&proxy_to(&upstream)).await;
        (sluice.addr, sluice)
    })
}

/// A counter as sluice's thread reads it.
async fn read_on(server: &tokio::runtime::Handle, counter: &'static LocalKey<Cell<u64>>) -> u64 {
    server
        .spawn(async { counter.with(Cell::get) })
        .await
        .unwrap()
}

/// sluice's own server and client serve a busy client's keep-alive request
/// with two allocations of sluice's thread: the upstream answer's fields
/// and its body's state. The box the requests are served in is the
/// connection's while its client is busy (see `front::serve`), the buffers
/// are the thread's spares, the upstream connection the pool's.
#[tokio::test]
async fn a_keep_alive_request_costs_two_allocations() {
    use tokio::io::AsyncReadExt;
    let (server, addr) = sluice_on_own_thread();
    let counted = || read_on(&server, &ALLOCATIONS);
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut exchange = async |n: u64| {
        for _ in 0..n {
            conn.write_all(b"GET /items?page=2 HTTP/1.1\r\nHost: api.example\r\nUser-Agent: test\r\nAccept: */*\r\n\r\n")
                .await
                .unwrap();
            let mut got = Vec::new();
            while !got.ends_with(b"\r\n\r\nok") {
                let mut chunk = [0u8; 4096];
                let n = conn.read(&mut chunk).await.unwrap();
                assert!(n > 0, "closed after {:?}", String::from_utf8_lossy(&got));
                got.extend_from_slice(&chunk[..n]);
            }
            assert!(got.starts_with(b"HTTP/1.1 200 OK\r\n"));
        }
    };
    // The first requests make the connection's buffers, its upstream
    // connection and the caches.
    exchange(100).await;
    let before = counted().await;
    exchange(1000).await;
    let made = counted().await - before;
    // A little room for the runtime's own (a timer wheel's level, a queue).
    assert!(
        made <= 2 * 1000 + 20,
        "{made} allocations for 1000 requests"
    );
}

/// HTTP/2 streams answered from one upstream connection reuse its read
/// buffer: hyper keeps an answer's fields and body until its connection's
/// task writes them (and HPACK's table keeps values for the connection's
/// life), so what it keeps is a copy, and the buffer is free for the
/// connection's next answer (`PooledBody::detach`). When they shared it,
/// about one stream in ten here cost a new 8 KB buffer (four in ten under
/// `h2load -c50 -m10`).
#[tokio::test]
async fn http2_streams_reuse_the_upstream_read_buffer() {
    let (server, addr) = sluice_on_own_thread();
    let large = || read_on(&server, &LARGE);
    let client = h2_client();
    let url = format!("http://{addr}/items");
    // `n` streams on the one connection, ten at a time: as one ends the
    // next begins, as a load generator sends them.
    let streams = async |n: usize| {
        use futures_util::stream::{FuturesUnordered, StreamExt};
        let get = || send(&client, Request::get(&url).body(empty()).unwrap());
        let mut flying: FuturesUnordered<_> = (0..10).map(|_| get()).collect();
        let mut begun = 10;
        while let Some(reply) = flying.next().await {
            assert_eq!(reply.status, 200);
            assert_eq!(&reply.body[..], b"ok");
            if begun < n {
                flying.push(get());
                begun += 1;
            }
        }
    };
    streams(200).await;
    let before = large().await;
    streams(1000).await;
    let made = large().await - before;
    assert!(
        made <= 20,
        "{made} allocations of 8 KB or more for 1000 streams"
    );
}
