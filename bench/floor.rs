//! The floor the bench measures sluice against: a TCP relay on the same
//! runtime and allocator as sluice (tokio, one current-thread worker,
//! mimalloc) that does no HTTP at all. Each client connection gets its own
//! upstream connection, and bytes are copied both ways until either side
//! closes, as a layer-4 proxy would.
//!
//! Under wrk it makes the same system calls a request as sluice (two reads,
//! two writes) and sends the same four TCP segments, so its CPU per request
//! is what any proxy built this way pays before its own work: the kernel's
//! part and the runtime's. What sluice spends above it is its HTTP work
//! (parsing, routing, rewriting the head, pooling, metrics).
//!
//! With `--http` it is instead the least an HTTP/1.1 reverse proxy does on
//! this runtime: it parses each request head (httparse), writes it upstream
//! without the hop-by-hop fields and with `X-Forwarded-For`, on a connection
//! from a shared keep-alive pool, parses the answer's head, and writes it
//! back the same way, the body framed by its `Content-Length`. No routing,
//! no limits, no metrics, no timeouts, no log, no `Date`: what sluice does
//! above this figure is its features (see README Performance).
//!
//! `cargo run --release --example floor -- [--http] LISTEN UPSTREAM`, both
//! `host:port`. Not a product: it has no timeouts and no limits, and the
//! HTTP mode serves only requests without a body, from an upstream that
//! frames its answers by length; anything else closes the connection.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let mut args = std::env::args().skip(1).peekable();
    let http = args.next_if(|a| a == "--http").is_some();
    let (Some(listen), Some(upstream)) = (args.next(), args.next()) else {
        eprintln!("usage: floor [--http] LISTEN UPSTREAM (both host:port)");
        std::process::exit(2);
    };
    let (Ok(listen), Ok(upstream)) = (listen.parse::<SocketAddr>(), upstream.parse::<SocketAddr>())
    else {
        eprintln!("floor: LISTEN and UPSTREAM must be host:port");
        std::process::exit(2);
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("floor: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    let served = if http {
        runtime.block_on(http_proxy(listen, upstream))
    } else {
        runtime.block_on(relay(listen, upstream))
    };
    if let Err(e) = served {
        eprintln!("floor: {e}");
        std::process::exit(1);
    }
}

async fn relay(listen: SocketAddr, upstream: SocketAddr) -> std::io::Result<()> {
    let listener = TcpListener::bind(listen).await?;
    loop {
        let (mut client, _) = listener.accept().await?;
        tokio::spawn(async move {
            let Ok(mut server) = TcpStream::connect(upstream).await else {
                return;
            };
            // As sluice does on both sides: a request or an answer goes out
            // the moment it is written.
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
        });
    }
}

/// Idle upstream connections, last in first out, shared by all clients.
type Pool = Arc<Mutex<Vec<TcpStream>>>;

async fn http_proxy(listen: SocketAddr, upstream: SocketAddr) -> std::io::Result<()> {
    let listener = TcpListener::bind(listen).await?;
    let pool: Pool = Arc::default();
    loop {
        let (client, peer) = listener.accept().await?;
        let _ = client.set_nodelay(true);
        let pool = pool.clone();
        tokio::spawn(async move {
            let _ = http_client(client, peer, upstream, pool).await;
        });
    }
}

/// Serves one client connection's requests until it closes or asks for
/// something this mode does not do.
async fn http_client(
    mut client: TcpStream,
    peer: SocketAddr,
    upstream: SocketAddr,
    pool: Pool,
) -> std::io::Result<()> {
    let peer_ip = peer.ip().to_string();
    let mut input = Vec::with_capacity(8192);
    let mut answer = Vec::with_capacity(8192);
    let mut out = Vec::with_capacity(8192);
    loop {
        // The request head, and where it ends.
        let used = loop {
            let mut fields = [httparse::EMPTY_HEADER; 64];
            let mut req = httparse::Request::new(&mut fields);
            if let httparse::Status::Complete(used) = req.parse(&input).map_err(invalid)? {
                out.clear();
                out.extend_from_slice(req.method.unwrap_or("GET").as_bytes());
                out.push(b' ');
                out.extend_from_slice(req.path.unwrap_or("/").as_bytes());
                out.extend_from_slice(b" HTTP/1.1\r\n");
                for f in req.headers.iter() {
                    if has_body(f.name, f.value) {
                        return Err(invalid("a request body"));
                    }
                    if !hop_by_hop(f.name) {
                        field(&mut out, f.name.as_bytes(), f.value);
                    }
                }
                field(&mut out, b"x-forwarded-for", peer_ip.as_bytes());
                out.extend_from_slice(b"\r\n");
                break used;
            }
            if client.read_buf(&mut input).await? == 0 {
                return Ok(());
            }
        };
        input.drain(..used);

        let popped = pool.lock().map_err(|_| invalid("pool"))?.pop();
        let mut server = match popped {
            Some(server) => server,
            None => {
                let server = TcpStream::connect(upstream).await?;
                let _ = server.set_nodelay(true);
                server
            }
        };
        server.write_all(&out).await?;

        // The answer's head, then its body by length.
        answer.clear();
        let (head, length) = loop {
            let mut fields = [httparse::EMPTY_HEADER; 64];
            let mut resp = httparse::Response::new(&mut fields);
            if let httparse::Status::Complete(head) = resp.parse(&answer).map_err(invalid)? {
                out.clear();
                out.extend_from_slice(b"HTTP/1.1 ");
                out.extend_from_slice(
                    itoa::Buffer::new()
                        .format(resp.code.unwrap_or(502))
                        .as_bytes(),
                );
                out.push(b' ');
                out.extend_from_slice(resp.reason.unwrap_or("").as_bytes());
                out.extend_from_slice(b"\r\n");
                let mut length = None;
                for f in resp.headers.iter() {
                    if f.name.eq_ignore_ascii_case("content-length") {
                        length = std::str::from_utf8(f.value)
                            .ok()
                            .and_then(|v| v.parse::<usize>().ok());
                    } else if hop_by_hop(f.name) {
                        continue;
                    }
                    field(&mut out, f.name.as_bytes(), f.value);
                }
                out.extend_from_slice(b"\r\n");
                break (
                    head,
                    length.ok_or_else(|| invalid("an answer not framed by length"))?,
                );
            }
            if server.read_buf(&mut answer).await? == 0 {
                return Err(invalid("the upstream closed"));
            }
        };
        while answer.len() < head + length {
            if server.read_buf(&mut answer).await? == 0 {
                return Err(invalid("the upstream closed"));
            }
        }
        if answer.len() > head + length {
            return Err(invalid("more than the answer"));
        }
        pool.lock().map_err(|_| invalid("pool"))?.push(server);
        out.extend_from_slice(&answer[head..]);
        client.write_all(&out).await?;
    }
}

fn field(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// The fields that are about one connection, not the message: the list
/// sluice drops (src/proxy/forward.rs; `Trailer` is not one).
fn hop_by_hop(name: &str) -> bool {
    [
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "transfer-encoding",
        "upgrade",
    ]
    .iter()
    .any(|h| name.eq_ignore_ascii_case(h))
}

fn has_body(name: &str, value: &[u8]) -> bool {
    name.eq_ignore_ascii_case("transfer-encoding")
        || (name.eq_ignore_ascii_case("content-length") && value != b"0")
}

fn invalid(why: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, why.to_string())
}
