//! Generated input for the configuration loader and its duration strings:
//! never a panic, and every refusal names `file:line:`. (The HTTP/1.1
//! parsers' property tests live beside them: src/front/props.rs and
//! src/proxy/h1/props.rs.)

use std::path::Path;
use std::time::Duration;

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::select;

const FILE: &str = "gen.toml";

fn words(list: &'static [&'static str]) -> impl Strategy<Value = String> {
    select(list).prop_map(str::to_string)
}

/// A TOML string literal holding `s`, whatever its characters.
fn quoted(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A string value a key might take: durations, sizes, addresses, URLs,
/// key specs, names, and any text.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => words(&[
            "1s", "250ms", "0s", "0ms", "1m", "1h", "1d", "1w", "1mo", "99999999999999999999d",
            "18446744073709551615ms", "1.5s", "-1s", " 1s ", "1S", "s", "", "1MiB", "0", "64KiB",
            "127.0.0.1:0", "[::1]:0", "0.0.0.0:99999", "localhost:80", "10.0.0.0/8", "::ffff:10.0.0.1/128",
            "redis://127.0.0.1:6379/0", "rediss://h/", "http://127.0.0.1:9/", "https://x", "ftp://x",
            "ip", "global", "header:X-Api-Key", "header:", "query:key", "trailer:x", "body-bytes",
            "/", "=/exact", "/api/", "", "GET", "get", "UTC", "Europe/Berlin", "Mars/Olympus",
            "reserve", "after", "enforce", "shadow", "fixed", "sliding", "log", "gcra", "concurrency",
            "redis", "memory", "allow", "deny", "local", "x-ratelimit", "ietf", "both", "none",
            "reject", "decode", "keep", "drop", "pass", "a", "gold",
        ]),
        2 => any::<String>(),
        1 => vec(any::<char>(), 0..300).prop_map(|c| c.into_iter().collect()),
    ]
    .prop_map(|s| quoted(&s))
}

/// A TOML value of any type.
fn value() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        4 => text(),
        2 => any::<i64>().prop_map(|n| n.to_string()),
        2 => words(&[
            "0", "1", "-1", "3", "100", "65535", "65536", "4294967296", "9223372036854775807",
            "-9223372036854775808", "99999999999999999999999", "0x10", "0o7", "0b1", "1_000",
            "1e308", "1e999", "-0.0", "0.5", "nan", "inf", "-inf", "true", "false",
            "1979-05-27T07:32:00Z", "07:32:00", "1979-05-27",
        ]),
    ];
    leaf.prop_recursive(4, 24, 4, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..4).prop_map(|v| format!("[{}]", v.join(", "))),
            vec((key(), inner), 0..4).prop_map(|kv| {
                let pairs: Vec<String> =
                    kv.into_iter().map(|(k, v)| format!("{k} = {v}")).collect();
                format!("{{ {} }}", pairs.join(", "))
            }),
        ]
    })
}

/// Keys sluice knows, and others.
fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => words(&[
            "listen", "workers", "admin_listen", "trusted_proxies", "upstream_timeout", "header_timeout",
            "max_header_bytes", "shutdown_timeout", "client_body_timeout", "max_connections",
            "escaped_slashes", "client_send_timeout", "max_streams", "underscore_headers", "backlog",
            "cert", "key", "backend", "url", "urls", "cluster", "timeout", "ca", "on_error", "clock",
            "prefix", "deny_cache", "max_keys", "style", "buffer", "pass_host", "limits", "limit",
            "window", "precision", "algorithm", "burst", "delay", "lease", "charge", "refund", "mode",
            "timezone", "ipv6_prefix", "meter", "plan_key", "plan_header", "path", "methods", "host",
            "upstream", "policy", "cost", "respond", "status", "body", "content_type", "name", "upgrades",
        ]),
        1 => "[a-z_]{1,12}",
        1 => any::<String>().prop_map(|s| quoted(&s)),
    ]
}

fn header() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => words(&[
            "[server]", "[server.tls]", "[store]", "[headers]", "[upstreams.api]", "[upstreams.b]",
            "[policies.standard]", "[policies.p.plans.gold]", "[policies.p.assign]", "[[routes]]",
            "[[policies.standard.limits]]",
        ]),
        1 => vec("[a-z]{1,4}", 1..6).prop_map(|p| format!("[{}]", p.join("."))),
        1 => (1usize..200).prop_map(|depth| format!("[{}]", vec!["a"; depth].join("."))),
        1 => words(&["[[x]]", "[server", "[]", "[[routes]", "[ server ]"]),
    ]
}

/// A configuration file: sections of `key = value` lines, now and then a
/// line of anything.
fn document() -> impl Strategy<Value = String> {
    let line = prop_oneof![
        12 => (key(), value()).prop_map(|(k, v)| format!("{k} = {v}")),
        1 => any::<String>(),
        1 => words(&["", "# comment", "=", "a =", "a = 1 2", "a.b.c = 1", "\"\" = 1"]),
    ];
    vec((header(), vec(line, 0..8)), 0..8).prop_map(|sections| {
        let mut out = String::new();
        for (header, lines) in sections {
            out += &header;
            out.push('\n');
            for line in lines {
                out += &line;
                out.push('\n');
            }
        }
        out
    })
}

/// A working configuration with one key's value replaced by a generated
/// one: so the checks after the TOML reading are reached.
fn near_valid() -> impl Strategy<Value = String> {
    let base = [
        "[server]",
        "listen = \"127.0.0.1:0\"",
        "upstream_timeout = \"30s\"",
        "max_header_bytes = 32768",
        "[upstreams.api]",
        "url = \"http://127.0.0.1:9000\"",
        "[policies.standard]",
        "key = \"ip\"",
        "limits = [{ limit = 10, window = \"1s\" }, { limit = 240, window = \"1h\", precision = \"1m\" }]",
        "[[routes]]",
        "path = \"/api/\"",
        "methods = [\"GET\"]",
        "upstream = \"api\"",
        "policy = \"standard\"",
        "cost = 5",
    ];
    let lines: Vec<String> = base.iter().map(|l| l.to_string()).collect();
    let n = lines.len();
    (0..n, value(), prop::option::of((key(), value()))).prop_map(move |(at, v, extra)| {
        let mut lines = lines.clone();
        if let Some((k, _)) = lines[at].split_once(" = ") {
            lines[at] = format!("{k} = {v}");
        }
        if let Some((k, v)) = extra {
            lines.insert(at + 1, format!("{k} = {v}"));
        }
        lines.join("\n") + "\n"
    })
}

/// `text` through the loader: a configuration, or messages that each name
/// the file and a line of it.
fn check_config(text: &str) -> Result<(), TestCaseError> {
    let Err(e) = sluice::config::parse(text, FILE, Path::new("/nonexistent")) else {
        return Ok(());
    };
    let lines = text.split('\n').count();
    let message = e.to_string();
    prop_assert!(!message.is_empty());
    for m in message.split('\n') {
        let rest = m.strip_prefix(FILE).and_then(|r| r.strip_prefix(':'));
        let (line, what) = rest.and_then(|r| r.split_once(": ")).unwrap_or_default();
        let line: usize = line.parse().unwrap_or(0);
        prop_assert!(
            (1..=lines).contains(&line) && !what.trim().is_empty(),
            "{m:?} in {message:?}"
        );
    }
    Ok(())
}

proptest! {
    #[test]
    fn a_generated_config_is_loaded_or_refused_with_file_and_line(text in document()) {
        check_config(&text)?;
    }

    #[test]
    fn a_config_with_one_generated_value_is_loaded_or_refused_with_file_and_line(text in near_valid()) {
        check_config(&text)?;
    }

    #[test]
    fn any_bytes_are_loaded_or_refused_with_file_and_line(bytes in vec(any::<u8>(), 0..400)) {
        check_config(&String::from_utf8_lossy(&bytes))?;
    }

    /// A duration reads back as written; anything else is refused with a
    /// reason, never a panic.
    #[test]
    fn durations_read_as_written(n in any::<u64>(), unit in select(&["ms", "s", "m", "h", "d"][..]), junk in ".{0,12}") {
        let ms = match unit { "ms" => 1, "s" => 1_000, "m" => 60_000, "h" => 3_600_000, _ => 86_400_000u64 };
        match sluice::config::duration::parse(&format!("{n}{unit}")) {
            Ok(d) => {
                prop_assert_eq!(Some(d), n.checked_mul(ms).map(Duration::from_millis));
                let again = sluice::config::duration::format(d);
                prop_assert_eq!(sluice::config::duration::parse(&again), Ok(d));
            }
            Err(why) => {
                prop_assert!(n.checked_mul(ms).is_none(), "{}", why);
                prop_assert!(why.contains("too large"));
            }
        }
        if let Err(why) = sluice::config::duration::parse(&junk) {
            prop_assert!(!why.is_empty());
        }
    }
}

/// Nesting far deeper than any file needs is refused, not a stack overflow.
#[test]
fn deep_nesting_is_refused_with_file_and_line() {
    for depth in [1_000, 100_000] {
        let arrays = format!("a = {}{}\n", "[".repeat(depth), "]".repeat(depth));
        let tables = format!("a = {}{}\n", "{ b = ".repeat(depth), "}".repeat(depth));
        let keys = format!("[{}]\n", vec!["a"; depth].join("."));
        for text in [arrays, tables, keys] {
            check_config(&text).unwrap();
        }
    }
}
