//! Test support: a real upstream HTTP server, sluice itself started in-process
//! on port 0, and a real HTTP client.
#![allow(dead_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use sluice::Server;
use sluice::clock::Clock;
use sluice::proxy::Proxy;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

pub type BoxBody = http_body_util::combinators::BoxBody<Bytes, hyper::Error>;

/// A real upstream on a free loopback port. What it does depends on the path:
///
/// - `.../status/N`: answers status N;
/// - `/slow/MS`: answers after MS milliseconds;
/// - `/tokens/V`: answers with `X-Tokens-Used: V` (a metered API);
/// - `/trailer/V/MS`: streams its body for MS ms, then `X-Tokens: V` in
///   its trailers (`none`: no trailers);
/// - `/bytes/N`: streams N bytes of body;
/// - `/upload`: reads the body as it comes and answers its length;
/// - `/upgrade`: switches protocols (101) to an echo of every byte;
/// - anything else: echoes the request as JSON (method, uri, headers, peer).
pub struct Upstream {
    pub addr: SocketAddr,
    pub hits: Arc<AtomicU64>,
    /// Connections accepted.
    pub conns: Arc<AtomicU64>,
}

impl Upstream {
    pub async fn start() -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hits = Arc::new(AtomicU64::new(0));
        let conns = Arc::new(AtomicU64::new(0));
        let counter = hits.clone();
        let accepted = conns.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, peer)) = listener.accept().await else {
                    continue;
                };
                accepted.fetch_add(1, Ordering::SeqCst);
                let hits = counter.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req| {
                        hits.fetch_add(1, Ordering::SeqCst);
                        upstream_answer(req, peer)
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection_with_upgrades(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Upstream { addr, hits, conns }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::SeqCst)
    }
}

async fn upstream_answer(
    mut req: Request<Incoming>,
    peer: SocketAddr,
) -> Result<Response<BoxBody>, Infallible> {
    let path = req.uri().path().to_string();
    if path == "/upgrade" {
        // Switches to an "echo" protocol: every byte comes back.
        let upgraded = hyper::upgrade::on(&mut req);
        tokio::spawn(async move {
            if let Ok(io) = upgraded.await {
                let mut io = TokioIo::new(io);
                let (mut r, mut w) = tokio::io::split(&mut io);
                let _ = tokio::io::copy(&mut r, &mut w).await;
            }
        });
        let mut r = Response::new(empty());
        *r.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
        r.headers_mut().insert("upgrade", "echo".parse().unwrap());
        r.headers_mut()
            .insert("connection", "upgrade".parse().unwrap());
        return Ok(r);
    }
    let full = |status: StatusCode, body: String| {
        let mut r = Response::new(Full::new(Bytes::from(body)).map_err(|e| match e {}).boxed());
        *r.status_mut() = status;
        r
    };
    if let Some((_, code)) = path.split_once("/status/") {
        let status = StatusCode::from_u16(code.parse().unwrap_or(500)).unwrap();
        let mut r = full(status, String::new());
        // A response with hop-by-hop headers the proxy must strip.
        r.headers_mut()
            .insert("keep-alive", "timeout=5".parse().unwrap());
        r.headers_mut()
            .insert("connection", "keep-alive, x-secret".parse().unwrap());
        r.headers_mut().insert("x-secret", "hop".parse().unwrap());
        r.headers_mut().insert("x-upstream", "yes".parse().unwrap());
        return Ok(r);
    }
    if path == "/claims" {
        // An upstream that counts on its own: the proxy's fields must win.
        let mut r = full(StatusCode::OK, "claims".into());
        for (name, value) in [
            ("x-ratelimit-limit", "7"),
            ("x-ratelimit-remaining", "99"),
            ("x-ratelimit-remaining", "98"),
            ("x-ratelimit-reset", "1"),
            ("ratelimit-policy", "\"up\";q=7;w=1"),
            ("ratelimit", "\"up\";r=99;t=1"),
            ("x-ratelimit-scope", "upstream"),
        ] {
            r.headers_mut().append(name, value.parse().unwrap());
        }
        return Ok(r);
    }
    if let Some(value) = path.strip_prefix("/tokens/") {
        // What a metered API says a request cost, in its head.
        let mut r = full(StatusCode::OK, "tokens".into());
        if let Ok(v) = http::HeaderValue::from_str(value) {
            r.headers_mut().insert("x-tokens-used", v);
        }
        return Ok(r);
    }
    if let Some(rest) = path.strip_prefix("/trailer/") {
        // `/trailer/VALUE/MS`: a streamed answer whose cost comes in its
        // trailers, MS ms after its first bytes ("none": no trailers).
        let (value, ms) = rest.split_once('/').unwrap_or((rest, "0"));
        let ms: u64 = ms.parse().unwrap_or(0);
        let mut trailers = http::HeaderMap::new();
        if let (false, Ok(v)) = (value == "none", http::HeaderValue::from_str(value)) {
            trailers.insert("x-tokens", v);
        }
        let stream = futures_util::stream::unfold(0, move |i| {
            let trailers = trailers.clone();
            async move {
                match i {
                    0 => Some((Ok::<_, hyper::Error>(Frame::data(Bytes::from("tok"))), 1)),
                    1 => {
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                        Some((Ok(Frame::data(Bytes::from("ens"))), 2))
                    }
                    2 if !trailers.is_empty() => Some((Ok(Frame::trailers(trailers)), 3)),
                    _ => None,
                }
            }
        });
        let mut r = Response::new(StreamBody::new(stream).boxed());
        r.headers_mut()
            .insert("trailer", "x-tokens".parse().unwrap());
        return Ok(r);
    }
    if let Some(ms) = path.strip_prefix("/slow/") {
        tokio::time::sleep(Duration::from_millis(ms.parse().unwrap_or(0))).await;
        return Ok(full(StatusCode::OK, "slow".into()));
    }
    if let Some(n) = path.strip_prefix("/bytes/") {
        let n: u64 = n.parse().unwrap_or(0);
        return Ok(Response::new(chunked_body(n)));
    }
    if let Some(ms) = path.strip_prefix("/drip/") {
        // "drip" in two chunks, `ms` apart: a response body that takes time.
        let ms: u64 = ms.parse().unwrap_or(0);
        let stream = futures_util::stream::unfold(0, move |i| async move {
            match i {
                0 => Some((Ok::<_, hyper::Error>(Frame::data(Bytes::from("dr"))), 1)),
                1 => {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    Some((Ok(Frame::data(Bytes::from("ip"))), 2))
                }
                _ => None,
            }
        });
        return Ok(Response::new(StreamBody::new(stream).boxed()));
    }
    if path == "/upload" {
        let mut body = req.into_body();
        let mut n = 0u64;
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame.map(|f| f.into_data()) {
                n += data.map(|d| d.len() as u64).unwrap_or(0);
            } else {
                break;
            }
        }
        return Ok(full(StatusCode::OK, n.to_string()));
    }
    let headers: serde_json::Map<String, serde_json::Value> = req
        .headers()
        .keys()
        .map(|k| {
            let values: Vec<serde_json::Value> = req
                .headers()
                .get_all(k)
                .iter()
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned().into())
                .collect();
            (k.as_str().to_string(), values.into())
        })
        .collect();
    let echo = serde_json::json!({
        "method": req.method().as_str(),
        "uri": req.uri().to_string(),
        "headers": headers,
        "peer": peer.to_string(),
    });
    Ok(full(StatusCode::OK, echo.to_string()))
}

/// A body of `n` zero bytes in 64 KiB chunks, made as it is sent.
pub fn chunked_body(n: u64) -> BoxBody {
    let chunk = Bytes::from(vec![0u8; 64 * 1024]);
    let stream = futures_util::stream::unfold(n, move |left| {
        let chunk = chunk.clone();
        async move {
            if left == 0 {
                return None;
            }
            let take = left.min(chunk.len() as u64);
            Some((
                Ok::<_, hyper::Error>(Frame::data(chunk.slice(..take as usize))),
                left - take,
            ))
        }
    });
    StreamBody::new(stream).boxed()
}

/// sluice, running in this process.
pub struct Sluice {
    pub addr: SocketAddr,
    /// The admin listener (`/healthz`, `/readyz`, `/metrics`).
    pub admin: SocketAddr,
    pub clock: Clock,
    pub proxy: Arc<Proxy>,
    stop: Option<oneshot::Sender<()>>,
    done: Option<tokio::task::JoinHandle<Result<(), sluice::ServerError>>>,
}

impl Sluice {
    /// Starts sluice with `config` (TOML text); `{upstream}` in it is replaced
    /// by the URL given.
    pub async fn start(config: &str) -> Sluice {
        Self::start_with_clock(config, Clock::system()).await
    }

    pub async fn start_with_clock(config: &str, clock: Clock) -> Sluice {
        let config = sluice::config::parse(config, "test.toml", std::path::Path::new("."))
            .unwrap_or_else(|e| panic!("test config is invalid:\n{e}"));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let admin_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let admin = admin_listener.local_addr().unwrap();
        let server = Server::with_clock(listener, config, clock.clone())
            .unwrap()
            .with_admin(admin_listener);
        let proxy = server.proxy();
        let (stop, stopped) = oneshot::channel();
        let done = tokio::spawn(server.run(async {
            let _ = stopped.await;
        }));
        Sluice {
            addr,
            admin,
            clock,
            proxy,
            stop: Some(stop),
            done: Some(done),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin, path)
    }

    /// The value of one Prometheus sample, e.g.
    /// `sluice_decisions_total{policy="p",plan="default",outcome="allowed"}`; 0 if absent.
    pub async fn metric(&self, sample: &str) -> f64 {
        let text = get(&self.admin_url("/metrics"), &[]).await;
        let text = String::from_utf8_lossy(&text.body).into_owned();
        text.lines()
            .find_map(|l| {
                l.strip_prefix(sample)
                    .and_then(|rest| rest.strip_prefix(' '))
            })
            .map_or(0.0, |v| v.trim().parse().unwrap())
    }

    /// Stops accepting and waits for the drain to end.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(done) = self.done.take() {
            done.await.unwrap().unwrap();
        }
    }
}

/// A response, read whole.
pub struct Reply {
    pub status: StatusCode,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// Every value of header `name`, in order.
    pub fn all(&self, name: &str) -> Vec<&str> {
        let values = self.headers.get_all(name).iter();
        values.map(|v| v.to_str().unwrap()).collect()
    }

    pub fn header_u64(&self, name: &str) -> u64 {
        self.header(name)
            .unwrap_or_else(|| panic!("no {name} header"))
            .parse()
            .unwrap()
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

/// A real HTTP/1.1 client with a connection pool.
pub fn client() -> Client<HttpConnector, BoxBody> {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// An HTTP/2 (prior knowledge) client.
pub fn h2_client() -> Client<HttpConnector, BoxBody> {
    Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(HttpConnector::new())
}

/// The smallest config: every path to one upstream at `url`, no policy.
pub fn proxy_to(url: &str) -> String {
    format!("[upstreams.api]\nurl = \"{url}\"\n[[routes]]\npath = \"/\"\nupstream = \"api\"\n")
}

pub fn empty() -> BoxBody {
    Full::new(Bytes::new()).map_err(|e| match e {}).boxed()
}

/// Sends `req` and reads the whole answer.
pub async fn send(client: &Client<HttpConnector, BoxBody>, req: Request<BoxBody>) -> Reply {
    let resp = client.request(req).await.expect("request failed");
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.expect("body failed").to_bytes();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

/// GET `url` with extra headers.
pub async fn get(url: &str, headers: &[(&str, &str)]) -> Reply {
    let mut req = Request::get(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    send(&client(), req.body(empty()).unwrap()).await
}

/// Sends raw bytes on a fresh TCP connection and returns what came back
/// before the server closed it (or `timeout` passed).
pub async fn raw(addr: SocketAddr, bytes: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let _ = s.write_all(bytes).await;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// Reads one request head (up to its blank line) from `stream`, for upstreams
/// scripted byte by byte; the requests they get carry no body that matters.
/// False once the connection has ended.
pub async fn read_request_head(stream: &mut tokio::net::TcpStream) -> bool {
    read_head(stream).await.is_some()
}

/// Reads from `stream` until a head's blank line has come; returns what was
/// read (the head, and any bytes after it in the same reads), or `None` if
/// the connection ended first.
pub async fn read_head(stream: &mut tokio::net::TcpStream) -> Option<String> {
    use tokio::io::AsyncReadExt;
    let mut head = Vec::new();
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let mut chunk = [0u8; 4096];
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(k) => head.extend_from_slice(&chunk[..k]),
        }
    }
    Some(String::from_utf8_lossy(&head).into_owned())
}

/// Polls `cond` until it holds (at most 5 s): for waiting on an event, never
/// for letting time pass.
pub async fn wait_until(mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "condition not met in 5 s"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Polls an async condition until it holds (at most 5 s).
pub async fn wait_until_async<F, Fut>(mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !cond().await {
        assert!(
            std::time::Instant::now() < deadline,
            "condition not met in 5 s"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// A loopback port with nothing listening on it.
pub async fn dead_port() -> SocketAddr {
    // The port stays bound, not listening, for the test binary's life: a
    // connection to it is refused, and nothing else can take it. A port
    // freed at once could be handed by the kernel to the next test that
    // binds port 0 (a redis-server, an upstream), which then answered here.
    static HELD: std::sync::OnceLock<(socket2::Socket, SocketAddr)> = std::sync::OnceLock::new();
    HELD.get_or_init(|| {
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
            .expect("a TCP socket");
        socket
            .bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
            .expect("a loopback port");
        let addr = socket.local_addr().unwrap().as_socket().unwrap();
        (socket, addr)
    })
    .1
}

/// A real `redis-server` on a free loopback port, stopped when dropped.
pub struct RedisServer {
    pub port: u16,
    child: std::process::Child,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        Self::start_on(port)
    }

    /// Starts a redis-server on `port` (e.g. again, after [`RedisServer::kill`]).
    pub fn start_on(port: u16) -> RedisServer {
        let child = std::process::Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server must be installed (.ci/run installs it)");
        let mut server = RedisServer { port, child };
        assert!(wait_for_ping(&mut server), "redis-server exited at start");
        server
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    pub fn client(&self) -> redis::Client {
        redis::Client::open(self.url()).unwrap()
    }

    pub fn conn(&self) -> redis::Connection {
        self.client().get_connection().unwrap()
    }

    /// Calls of one command since the last `CONFIG RESETSTAT`.
    pub fn calls(&self, command: &str) -> u64 {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut self.conn())
            .unwrap();
        info.lines()
            .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
            .and_then(|rest| rest.split(',').next())
            .map_or(0, |n| n.parse().unwrap())
    }

    /// Commands sent by clients (round trips) since the last reset: every
    /// call counted by `INFO commandstats`, less housekeeping and less the
    /// commands our Lua scripts run inside an EVALSHA (Redis counts those too).
    pub fn round_trips(&self) -> u64 {
        const INSIDE_SCRIPTS: [&str; 13] = [
            "hgetall",
            "hincrby",
            "hdel",
            "hget",
            "pexpire",
            "zremrangebyscore",
            "zcard",
            "zrange",
            "zadd",
            "zrem",
            "get",
            "set",
            "time",
        ];
        // The test's own INFO/CONFIG, what connections and the cluster
        // client do on their own (topology, liveness), and a replica's
        // REPLCONF ACK to its master (once a second) are not round trips of a
        // request.
        const HOUSEKEEPING: [&str; 10] = [
            "info", "config", "cluster", "ping", "client", "hello", "readonly", "command",
            "select", "replconf",
        ];
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut self.conn())
            .unwrap();
        info.lines()
            .filter_map(|l| l.strip_prefix("cmdstat_"))
            .filter_map(|l| l.split_once(":calls="))
            .filter(|(name, _)| {
                let base = name.split('|').next().unwrap();
                !HOUSEKEEPING.contains(&base) && !INSIDE_SCRIPTS.contains(&base)
            })
            .map(|(_, rest)| rest.split(',').next().unwrap().parse::<u64>().unwrap())
            .sum()
    }

    pub fn reset_stats(&self) {
        let _: () = redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query(&mut self.conn())
            .unwrap();
    }
}

impl RedisServer {
    /// Kills the server (SIGKILL): a crash, not a shutdown.
    pub fn kill(mut self) -> u16 {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.port
    }

    /// Freezes (SIGSTOP) or thaws (SIGCONT) the server: a hung Redis.
    pub fn signal(&self, signal: &str) {
        assert!(self.send_signal(signal), "kill {signal} failed");
    }

    fn send_signal(&self, signal: &str) -> bool {
        std::process::Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }
}

impl RedisServer {
    /// Whether this server is a master now (a replica may have been promoted).
    pub fn is_master(&self) -> bool {
        let Ok(mut c) = self.client().get_connection() else {
            return false;
        };
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query(&mut c)
            .unwrap_or_default();
        info.contains("role:master")
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.send_signal("-CONT");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A real Redis Cluster on loopback: `masters` masters, one replica each,
/// made with `redis-cli --cluster create`. Stopped when dropped.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
    dir: std::path::PathBuf,
}

impl RedisCluster {
    pub fn start(masters: usize) -> RedisCluster {
        let dir = std::env::temp_dir().join(format!(
            "sluice-cluster-{}-{}",
            std::process::id(),
            NEXT_CLUSTER.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let nodes: Vec<RedisServer> = (0..masters * 2).map(|_| start_cluster_node(&dir)).collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = std::process::Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = RedisCluster { nodes, dir };
        cluster.wait_until_ok();
        cluster
    }

    /// Waits until every live node says the cluster is ok, with all slots
    /// served and every replica in sync.
    pub fn wait_until_ok(&self) {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            // Every node sees all slots served, and every replica has synced
            // (a replica that never synced will not stand in for its master).
            let ok = self.live_nodes().all(|n| {
                let mut c = n.conn();
                let info: String = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query(&mut c)
                    .unwrap_or_default();
                let repl: String = redis::cmd("INFO")
                    .arg("replication")
                    .query(&mut c)
                    .unwrap_or_default();
                info.contains("cluster_state:ok")
                    && info.contains("cluster_slots_ok:16384")
                    && (repl.contains("role:master") || repl.contains("master_link_status:up"))
            });
            if ok {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "cluster not ok in 20 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn live_nodes(&self) -> impl Iterator<Item = &RedisServer> {
        self.nodes
            .iter()
            .filter(|n| n.client().get_connection().is_ok())
    }

    /// The seed URLs, as TOML array items.
    pub fn seeds_toml(&self) -> String {
        let urls: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("\"redis://127.0.0.1:{}\"", n.port))
            .collect();
        urls.join(", ")
    }

    pub fn seeds(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("redis://127.0.0.1:{}", n.port))
            .collect()
    }

    /// A connection that follows redirects.
    pub fn conn(&self) -> redis::cluster::ClusterConnection {
        redis::cluster::ClusterClient::new(self.seeds())
            .unwrap()
            .get_connection()
            .unwrap()
    }

    /// Every key on every live master.
    pub fn keys(&self) -> Vec<String> {
        let mut keys = Vec::new();
        for n in self.live_nodes() {
            let role: String = redis::cmd("ROLE")
                .query::<Vec<redis::Value>>(&mut n.conn())
                .map_or(String::new(), |v| match v.first() {
                    Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
                    _ => String::new(),
                });
            if role == "master" {
                let k: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut n.conn()).unwrap();
                keys.extend(k);
            }
        }
        keys
    }

    /// Kills the master serving `key`'s slot; returns its index in `nodes`.
    pub fn kill_master_of(&mut self, key: &str) -> usize {
        let i = self.master_of(key);
        let _ = self.nodes[i].child.kill();
        let _ = self.nodes[i].child.wait();
        i
    }

    /// The index in `nodes` of the master serving `key`'s slot, once its
    /// replica has caught up with it.
    pub fn master_of(&self, key: &str) -> usize {
        let conn = &mut self.nodes[0].conn();
        let slot: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query(conn)
            .unwrap();
        let slots: Vec<redis::Value> = redis::cmd("CLUSTER").arg("SLOTS").query(conn).unwrap();
        let mut port = None;
        for range in slots {
            let redis::Value::Array(parts) = range else {
                continue;
            };
            let (
                Some(redis::Value::Int(lo)),
                Some(redis::Value::Int(hi)),
                Some(redis::Value::Array(master)),
            ) = (parts.first(), parts.get(1), parts.get(2))
            else {
                continue;
            };
            if (*lo..=*hi).contains(&i64::from(slot))
                && let Some(redis::Value::Int(p)) = master.get(1)
            {
                port = Some(*p as u16);
            }
        }
        let port = port.expect("no master for the slot");
        let i = self.nodes.iter().position(|n| n.port == port).unwrap();
        // Replication is asynchronous: wait until the replica has everything
        // the master has, so the test measures failover, not lost writes.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let info: String = redis::cmd("INFO")
                .arg("replication")
                .query(&mut self.nodes[i].conn())
                .unwrap();
            let field = |name: &str| {
                info.lines()
                    .find_map(|l| l.strip_prefix(name))
                    .map(|v| v.trim().to_string())
            };
            let master = field("master_repl_offset:");
            let replica = field("slave0:").and_then(|l| {
                l.split(',')
                    .find_map(|kv| kv.strip_prefix("offset="))
                    .map(str::to_string)
            });
            if master.is_some() && master == replica {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "replica never caught up: {info}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        i
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            let _ = n.child.kill();
            let _ = n.child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

static NEXT_CLUSTER: AtomicU64 = AtomicU64::new(0);

/// A free port whose cluster bus port (port + 10000) exists and is free too.
fn free_cluster_port() -> u16 {
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if port < 55_000 && std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

/// A cluster node on a free port. Another process can take the port, or its
/// bus port (+10,000), between the check and the start (tests run in
/// parallel); the node then exits, and it is started again on other ports.
fn start_cluster_node(dir: &std::path::Path) -> RedisServer {
    for _ in 0..10 {
        let port = free_cluster_port();
        let child = std::process::Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "1000"])
            .args(["--cluster-config-file", &format!("nodes-{port}.conf")])
            .arg("--dir")
            .arg(dir)
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server must be installed (.ci/run installs it)");
        let mut node = RedisServer { port, child };
        if wait_for_ping(&mut node) {
            return node;
        }
    }
    panic!("no cluster node could start in 10 attempts");
}

/// Waits until `server` answers (true) or its process has exited (false).
fn wait_for_ping(server: &mut RedisServer) -> bool {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(mut c) = server.client().get_connection()
            && redis::cmd("PING").query::<String>(&mut c).is_ok()
        {
            return true;
        }
        if matches!(server.child.try_wait(), Ok(Some(_))) {
            return false;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "redis-server did not start"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Either a single Redis or a Redis Cluster, so one test runs on both.
pub enum TestRedis {
    Single(RedisServer),
    Cluster(RedisCluster),
}

impl TestRedis {
    /// The `[store]` lines that point sluice at it.
    pub fn store_toml(&self) -> String {
        match self {
            TestRedis::Single(r) => format!("url = \"{}\"", r.url()),
            TestRedis::Cluster(c) => format!("cluster = [{}]", c.seeds_toml()),
        }
    }

    fn servers(&self) -> Vec<&RedisServer> {
        match self {
            TestRedis::Single(r) => vec![r],
            // Replicas replay what masters did: only masters serve clients.
            TestRedis::Cluster(c) => c.nodes.iter().filter(|n| n.is_master()).collect(),
        }
    }

    pub fn reset_stats(&self) {
        self.servers().iter().for_each(|s| s.reset_stats());
    }

    /// Round trips from clients, summed over every node.
    pub fn round_trips(&self) -> u64 {
        self.servers().iter().map(|s| s.round_trips()).sum()
    }

    /// EVALSHA calls, summed over every node.
    pub fn evalsha_calls(&self) -> u64 {
        self.servers().iter().map(|s| s.calls("evalsha")).sum()
    }

    pub fn script_flush(&self) {
        for s in self.servers() {
            let _: () = redis::cmd("SCRIPT")
                .arg("FLUSH")
                .query(&mut s.conn())
                .unwrap();
        }
    }

    pub fn keys(&self) -> Vec<String> {
        match self {
            TestRedis::Single(r) => redis::cmd("KEYS").arg("*").query(&mut r.conn()).unwrap(),
            TestRedis::Cluster(c) => c.keys(),
        }
    }

    /// Runs a command about one key, on the node that holds it.
    pub fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> T {
        match self {
            TestRedis::Single(r) => cmd.query(&mut r.conn()).unwrap(),
            TestRedis::Cluster(c) => cmd.query(&mut c.conn()).unwrap(),
        }
    }
}

/// Runs an async test body once on a single Redis and once on a cluster, as
/// two tests: `name::single` and `name::cluster`.
#[macro_export]
macro_rules! on_both {
    ($name:ident, $body:ident) => {
        mod $name {
            #[tokio::test]
            async fn single() {
                super::$body(super::support::TestRedis::Single(
                    super::support::RedisServer::start(),
                ))
                .await;
            }
            #[tokio::test]
            async fn cluster() {
                super::$body(super::support::TestRedis::Cluster(
                    super::support::RedisCluster::start(3),
                ))
                .await;
            }
        }
    };
}

/// HTTP/2 frames in `bytes`: (type, payload), as far as they are whole.
pub fn h2_frames(bytes: &[u8]) -> Vec<(u8, Vec<u8>)> {
    let mut frames = Vec::new();
    let mut at = 0;
    while bytes.len() >= at + 9 {
        let len = u32::from_be_bytes([0, bytes[at], bytes[at + 1], bytes[at + 2]]) as usize;
        let Some(payload) = bytes.get(at + 9..at + 9 + len) else {
            break;
        };
        frames.push((bytes[at + 3], payload.to_vec()));
        at += 9 + len;
    }
    frames
}

/// A Redis store for store-level tests, on a server (`url`) or a cluster
/// (`cluster`'s seeds), its keys under `prefix`.
pub fn store_with_clock(
    url: Option<String>,
    cluster: Vec<String>,
    prefix: &str,
    clock: sluice::config::ClockSource,
) -> sluice::store::redis::RedisStore {
    use sluice::config::{Backend, OnError, StoreConfig};
    sluice::store::redis::RedisStore::new(&StoreConfig {
        backend: Backend::Redis,
        url,
        cluster,
        timeout: Duration::from_secs(2),
        ca: None,
        on_error: OnError::Deny,
        clock,
        prefix: prefix.to_string(),
        deny_cache: false,
        max_keys: 1_000_000,
    })
    .unwrap()
}

/// [`store_with_clock`] on the proxy's clock.
pub fn store_at(
    url: Option<String>,
    cluster: Vec<String>,
    prefix: &str,
) -> sluice::store::redis::RedisStore {
    store_with_clock(url, cluster, prefix, sluice::config::ClockSource::Local)
}
