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
//! `cargo run --release --example floor -- LISTEN UPSTREAM`, both
//! `host:port`. Not a product: it has no timeouts and no limits.

use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpStream};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let mut args = std::env::args().skip(1);
    let (Some(listen), Some(upstream)) = (args.next(), args.next()) else {
        eprintln!("usage: floor LISTEN UPSTREAM (both host:port)");
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
    if let Err(e) = runtime.block_on(relay(listen, upstream)) {
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
