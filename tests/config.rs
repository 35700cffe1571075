//! Configuration checking and the command line. Each file in
//! `tests/fixtures/invalid/` holds one mistake and, on its first line, the
//! message (`# expect: file:line: ...`) sluice must give for it.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn sluice() -> Command {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
}

#[test]
fn every_invalid_fixture_is_refused_with_its_file_line_and_key() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/invalid");
    let mut seen = 0;
    let mut wrong = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let expect = text
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("# expect: "))
            .unwrap_or_else(|| panic!("{} has no '# expect:' line", path.display()));
        let name = path.file_name().unwrap().to_str().unwrap();
        let err = sluice::config::parse(&text, name, &dir)
            .err()
            .unwrap_or_else(|| panic!("{name} was accepted"))
            .to_string();
        if !err.starts_with(expect.trim_end()) {
            wrong.push(format!("{name}:\n  expected: {expect}\n  got:      {err}"));
        }
        seen += 1;
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert!(seen >= 20, "only {seen} fixtures");
}

#[test]
fn all_problems_are_reported_at_once() {
    let text = "[policies.p]\nlimits = [{ limit = 0, window = \"1s\" }]\n[[routes]]\npath = \"/\"\nupstream = \"x\"\n";
    let err = sluice::config::parse(text, "c.toml", Path::new("."))
        .unwrap_err()
        .to_string();
    assert_eq!(err.lines().count(), 2, "{err}");
    assert!(
        err.contains("c.toml:2:") && err.contains("c.toml:5:"),
        "{err}"
    );
}

#[test]
fn shipped_config_is_valid() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config.toml");
    let config = sluice::config::load(&path).unwrap();
    assert!(!config.routes.is_empty());
}

#[test]
fn version_flag() {
    let out = sluice().arg("--version").output().unwrap();
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("sluice {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn check_prints_the_compiled_config_or_the_problems() {
    let good = sluice()
        .args(["check", "--config"])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("config.toml"))
        .output()
        .unwrap();
    assert!(good.status.success());
    let listing = String::from_utf8_lossy(&good.stdout);
    assert!(
        listing.contains("=/ping -> respond 200, policy demo"),
        "{listing}"
    );
    assert!(listing.contains("5 per 10s by ip, fixed"), "{listing}");

    let bad = sluice()
        .args(["check", "--config"])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/invalid/precision.toml"))
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(stderr.contains("precision.toml:5: policy 'p'"), "{stderr}");

    let missing = sluice()
        .args(["check", "--config", "/nonexistent/sluice.toml"])
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("cannot read"));
}

#[test]
fn runs_from_the_command_line_and_exits_0_on_sigterm() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = std::env::temp_dir().join(format!("sluice-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("config.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\nworkers = 1\n\
             [[routes]]\npath = \"=/ping\"\nrespond = {{ status = 200, body = \"pong\" }}\n"
        ),
    )
    .unwrap();
    let mut child = sluice()
        .env("SLUICE_CONFIG", &config)
        .args(["--log-format", "json"])
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for the port to answer (an event, not a delay).
    let deadline = Instant::now() + Duration::from_secs(10);
    let reply = loop {
        use std::io::{Read, Write};
        if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            s.write_all(b"GET /ping HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                .unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).unwrap();
            break out;
        }
        assert!(Instant::now() < deadline, "sluice did not start");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(reply.ends_with("pong"), "{reply}");
    // Read while it serves, checked once it is stopped (a failed check
    // must not leave it running).
    let proc_status =
        std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap_or_default();

    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0));
    // Serving, it had turned transparent huge pages off for itself.
    #[cfg(target_os = "linux")]
    {
        let thp = proc_status.lines().find(|l| l.starts_with("THP_enabled:"));
        assert_eq!(
            thp.map(|l| l.split_whitespace().nth(1)),
            Some(Some("0")),
            "{proc_status}"
        );
    }
    let mut logs = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut logs).unwrap();
    // JSON logs, one access event for the request, without its query.
    let access = logs
        .lines()
        .find(|l| l.contains("sluice::access"))
        .unwrap_or_else(|| panic!("no access log in:\n{logs}"));
    let event: serde_json::Value = serde_json::from_str(access).unwrap();
    assert_eq!(event["fields"]["path"], "/ping");
    assert_eq!(event["fields"]["status"], 200);
    std::fs::remove_dir_all(&dir).ok();
}

/// One request on an open HTTP/1.1 connection; returns the body.
fn ask(conn: &mut std::net::TcpStream, path: &str) -> String {
    use std::io::{BufRead, BufReader, Read, Write};
    conn.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes())
        .unwrap();
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut length = 0;
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            length = v.trim().parse().unwrap();
        }
        if line == "\r\n" {
            break;
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).unwrap();
    String::from_utf8(body).unwrap()
}

#[test]
fn sighup_reloads_a_good_file_and_refuses_a_broken_one() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = std::env::temp_dir().join(format!("sluice-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("config.toml");
    let write = |body: &str| {
        std::fs::write(
            &config,
            format!(
                "[server]\nlisten = \"127.0.0.1:{port}\"\nworkers = 1\n\
                 [[routes]]\npath = \"=/ping\"\nrespond = {{ status = 200, body = \"{body}\" }}\n"
            ),
        )
        .unwrap()
    };
    write("one");
    let mut child = sluice()
        .arg("--config")
        .arg(&config)
        // No access log: nobody reads the pipe until the end, and a full pipe
        // would block the server.
        .env("RUST_LOG", "info,sluice::access=off")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut conn = loop {
        if let Ok(c) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            break c;
        }
        assert!(Instant::now() < deadline, "sluice did not start");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(ask(&mut conn, "/ping"), "one");
    let hup = || {
        assert!(
            Command::new("kill")
                .args(["-HUP", &child.id().to_string()])
                .status()
                .unwrap()
                .success()
        );
    };

    write("two");
    hup();
    // The same keep-alive connection sees the new config once it is in.
    let deadline = Instant::now() + Duration::from_secs(10);
    while ask(&mut conn, "/ping") != "two" {
        assert!(Instant::now() < deadline, "reload did not take effect");
        std::thread::sleep(Duration::from_millis(20));
    }

    std::fs::write(&config, "[server\nbroken").unwrap();
    hup();
    let refused = Instant::now();
    // Still serving the last good config, on the same connection.
    while refused.elapsed() < Duration::from_millis(300) {
        assert_eq!(ask(&mut conn, "/ping"), "two");
    }
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    assert_eq!(child.wait().unwrap().code(), Some(0));
    let mut logs = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut logs).unwrap();
    assert!(logs.contains("configuration reloaded"), "{logs}");
    assert!(logs.contains("configuration refused"), "{logs}");
    assert!(
        logs.contains("unclosed table"),
        "the reason is logged: {logs}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn limits_of_one_window_with_different_keys_get_their_own_ids() {
    let text = "[policies.p]\nlimits = [\n  { limit = 100, window = \"1h\", key = \"global\" },\n  { limit = 2, window = \"1h\" },\n  { limit = 9, window = \"1m\" },\n]\n";
    let config = sluice::config::parse(text, "c.toml", Path::new(".")).unwrap();
    let ids: Vec<&str> = config.policies[0]
        .limits
        .iter()
        .map(|l| l.id.as_str())
        .collect();
    assert_eq!(ids, ["1h:fixed@global", "1h:fixed@ip", "1m:fixed"]);
    // The same keys in another order are the same limit twice.
    let dup = "[policies.p]\nlimits = [\n  { limit = 1, window = \"1h\", key = [\"ip\", \"global\"] },\n  { limit = 2, window = \"1h\", key = [\"global\", \"ip\"] },\n]\n";
    let err = sluice::config::parse(dup, "c.toml", Path::new("."))
        .unwrap_err()
        .to_string();
    assert!(err.contains("counts the same window as limits[0]"), "{err}");
}

#[test]
fn calendar_windows_follow_the_policy_timezone() {
    let text = r#"
[policies.utc]
limits = [{ limit = 5, window = "1d" }, { limit = 50, window = "1w" }, { limit = 500, window = "1mo" }]
[policies.berlin]
timezone = "Europe/Berlin"
limits = [
  { limit = 5, window = "1d" },
  { limit = 9, window = "1d", precision = "1h" },
  { limit = 500, window = "1mo" },
]
"#;
    let config = sluice::config::parse(text, "c.toml", Path::new(".")).unwrap();
    let by_name = |name: &str| {
        config
            .policies
            .iter()
            .find(|p| &*p.name == name)
            .unwrap()
            .clone()
    };
    let (berlin, utc) = (by_name("berlin"), by_name("utc"));
    // In UTC a day is the epoch's day, as before (its counters stay); weeks
    // and months are calendar windows in any zone.
    let kinds = |p: &sluice::config::Policy| -> Vec<(String, String, bool)> {
        p.limits
            .iter()
            .map(|l| (l.window_text(), l.id.clone(), l.calendar.is_some()))
            .collect()
    };
    let row = |w: &str, id: &str, calendar: bool| (w.to_string(), id.to_string(), calendar);
    assert_eq!(
        kinds(&utc),
        [
            row("1d", "1d:fixed", false),
            row("1w", "1w:fixed", true),
            row("1mo", "1mo:fixed", true)
        ]
    );
    // Outside UTC a fixed day starts at local midnight; a sliding day is a
    // span of 24 hours wherever it is.
    assert_eq!(
        kinds(&berlin),
        [
            row("1d", "1d:fixed", true),
            row("1d", "1d:sliding:1h", false),
            row("1mo", "1mo:fixed", true)
        ]
    );
    assert_eq!(&*berlin.timezone, "Europe/Berlin");
    assert_eq!(&*utc.timezone, "UTC");
    // The IETF policy names the calendar window as the file does.
    assert!(
        utc.ietf.lists[2].starts_with("\"utc-1mo\";q=500;w=2592000"),
        "{}",
        utc.ietf.lists[2]
    );
}
